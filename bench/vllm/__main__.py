"""kvtier inside vLLM's CPU build, side by side with vLLM's own caches: what a user pays,
measured in one run.

``python -m bench.vllm [--json] [--models tiny,mid] [--lengths 1024,4096] [--cases ...]``
(in .venv-vllm: ``make vllm``). For each model (``testing.vllm_models``: seeded random
Llamas saved locally) the engines run one after another, each in its own child process
(``bench.vllm.engine``), every one on the same CPU cores (see "Why engines differed"):

- plain: no connector, vLLM's prefix cache on. Per prompt length: the first-token time on a
  miss (``ttft_miss_s``: prompts never seen, the median of ``--repeats``), then on vLLM's
  own prefix-cache hit (``ttft_prefix_cache_s``: the in-memory ceiling), and the greedy
  outputs every other engine must reproduce.
- kvtier: ``KVTierConnector`` against a live kvtier server (its own process) whose host RAM
  tier holds everything. The same never-seen prompts as the plain engine's misses, now
  stored as they are computed (``ttft_miss_connector_s``, and ``miss_connector_vs_miss``);
  then a hit served from the server's host tier (``ttft_kvtier_host_hit_s``;
  ``ttft_kvtier_hit_s`` is the same figure under its old name), a second prompt sharing its
  prefix, and a three-turn session (``kvtier_session``) resumed turn after turn; vLLM's
  prefix cache is emptied before each step a hit must come from kvtier
  (``connector_plan``). Last, the hung server: the server process is SIGSTOPped (its socket
  still accepts; nothing answers) for one never-seen prompt, and resumed after it or after
  ``HUNG_CAP_S``; ``hung_server_stall_s`` is that request's first-token time less the
  healthy ``ttft_miss_connector_s`` (``hung_server_capped``: the cap was reached, the true
  stall is longer).
- kvtier-disk: the server restarted over the same data with a host tier smaller than one
  chunk, and a fresh engine: every hit is read from disk (``ttft_kvtier_disk_hit_s``; the
  OS page cache is not dropped, which needs root on a shared machine: a warm disk).
- kvtier-down: an engine whose connector points at an address where nothing listens runs
  the plain engine's requests up to its last misses (``down_plan``), so each length's
  first miss comes after the same requests in both engines (the first length's is each
  engine's first request past the warm-up every engine runs, ``bench.vllm.engine``).
  ``ttft_kvtier_down_s`` is the down engine's first miss at that length, compared with the
  plain engine's first (``ttft_first_miss_s``; ``down_vs_miss``): an engine's first request
  at a length pays first-use costs a warm median (``ttft_miss_s``) does not.
  ``ttft_miss_kvtier_down_s`` is the median of the down engine's misses. An engine that
  refuses to start says so in ``down_engine.start_error`` and the keys are null.
- example: vLLM's ``ExampleConnector`` (safetensors files), the way kvtier's hits are
  measured (``ttft_example_hit_s``), and the references below.

Model kinds (``--kinds full,hybrid,sliding``, ``bench.vllm.kinds``): per kind, one more
engine (a full-attention Llama, a Gemma3-like hybrid, an all-sliding Mistral) gives
``stored_vs_own_cache`` (kvtier's stored bytes per token over the engine's own cache's,
per group too), hit first-token times and ``identical`` (top-5 logprobs of a kvtier hit
equal vLLM's own prefix-cache hit's); ``--models ''`` runs the kinds alone.

``--cases`` picks the optional measurements (``connector_miss``, ``hung``, ``disk``,
``down``; all by default); one not run is null, and ``not_measured`` names it and why.

``identical_outputs``: kvtier's greedy outputs equal those the engine gives from the same KV
held in vLLM's own prefix cache (same blocks cached, same tokens computed): a miss equals the
example engine's miss, a kvtier hit of P (from host RAM or disk) equals P served from vLLM's
prefix cache, the shared-prefix prompt equals the example engine's (its shared blocks from
vLLM's cache), and each session turn equals the example engine's turn (the earlier turns'
blocks from vLLM's cache). Bit-exact KV gives exactly these; a wrong block would not. The
outputs of the engine without any connector are reported beside them
(``identical_to_no_connector_engine``, ``session.first_divergence_from_no_connector``).

Why engines differed. Earlier runs found kvtier's and ExampleConnector's outputs unlike the
plain engine's, e.g. a three-turn session diverging at token 7 of turn 3, though identical
to the same engine serving from its own prefix cache. The cause is vLLM's CPU platform, not
the KV: with any ``kv_transfer_config`` it reserves one more core (for NIXL,
``vllm/utils/ompmultiprocessing.py``), and on a 2-core machine that leaves nothing to
reserve, so a connector engine's worker ran 2 OpenMP threads on both cores while the plain
engine's ran 1. Matrix products split over a different number of threads round bf16
differently; on random weights the next-token distribution is flat (exact ties occur), so a
greedy pick flips after a few decode steps (turn 1 already differed at token 2 in a tiny-model
trial; its prefill logits were equal), and each later turn, built from its engine's own
answer, then has another prompt altogether. Each engine's outputs equalled its own full
prefill and its own prefix-cache hits. Every engine now runs with
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (the plain engine's default), so they get the same cores
and threads, and connector engines no longer get a core more for their compute; in the
runs since, every engine's outputs agreed (``identical_to_no_connector_engine``).

``load_GBps``/``store_GBps`` come from the connector's counters (bytes and seconds of its
loads and saves); ``memcpy_GBps`` is the best of five ``torch.clone`` of a tensor the size
of one load (its mean bytes), on one thread like the engine's worker, in this process right
after the engine (``load_vs_memcpy``, ``store_vs_memcpy``). ``bytes_per_token`` comes from
the server's disk tier over the tokens the connector stored. Times are medians of
``--repeats`` runs. ``goal`` holds the issue's goals for the headline case (the largest
prompt of the last model; mid at 4096 tokens in the quick and full sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.vllm.kinds import KINDS, bench_kind
from testing import vllm_models
from testing.live_server import LiveServer, free_port

ROOT = Path(__file__).resolve().parent.parent.parent
OUTPUT_TOKENS = 32
MODELS = {"tiny": vllm_models.TINY, "mid": vllm_models.MID}
TENANT = "bench"
CASES = ("connector_miss", "hung", "disk", "down")
HUNG_CAP_S = 30.0  # a request waiting on a hung server longer is measured as this
ENGINE_TIMEOUT_S = 3600.0
HOST_TIER = str(4 << 30)  # holds every chunk of a run
DISK_TIER = str(8 << 30)
TOO_SMALL_HOST_TIER = "1024"  # smaller than one chunk: every chunk lives on disk alone
# (key, how the headline's value compares, limit): the goals at mid 4k
GOALS = (("host_hit_vs_example_hit", "<=", 1.0), ("host_hit_vs_prefix_cache", "<=", 1.3),
         ("disk_hit_vs_example_hit", "<=", 1.0), ("miss_connector_vs_miss", "<=", 1.05),
         ("load_vs_memcpy", ">=", 0.3), ("hung_server_stall_s", "<=", 0.05),
         ("down_vs_miss", "<=", 1.1))


def prompts(spec: vllm_models.LlamaSpec, length: int) -> dict[str, list[int]]:
    """A prompt of ``length`` tokens and a second one sharing its first three quarters."""
    shared = vllm_models.prompt(spec, length * 3 // 4, seed=length)
    return {"P": shared + vllm_models.prompt(spec, length - len(shared), seed=length + 1),
            "Q": shared + vllm_models.prompt(spec, length - len(shared), seed=length + 2)}


def miss_prompts(spec: vllm_models.LlamaSpec, length: int, repeats: int) -> list[list[int]]:
    """Prompts no engine saw before, then P, ``repeats`` in all: each one a miss. P comes
    last, so vLLM's prefix cache (emptied before each) holds it after them."""
    return [vllm_models.prompt(spec, length, seed=1000 * length + i)
            for i in range(1, repeats)] + [prompts(spec, length)["P"]]


def hung_prompt(spec: vllm_models.LlamaSpec, length: int) -> list[int]:
    return vllm_models.prompt(spec, length, seed=1000 * length + 999)


def session_turns(spec: vllm_models.LlamaSpec, name: str = "turn") -> list[dict]:
    """Three turns of one session: 1k tokens, then each turn appends 256 new tokens to the
    previous prompt and its answer."""
    turns = [{"name": f"{name}1", "prompt": vllm_models.prompt(spec, 1024, seed=7)}]
    for n in (2, 3):
        turns.append({"name": f"{name}{n}", "extend": {
            "after": f"{name}{n - 1}", "append": vllm_models.prompt(spec, 256, seed=7 + n)}})
    return turns


def plain_plan(lengths, spec, repeats: int) -> list[dict]:
    steps = []
    for n in lengths:
        p = prompts(spec, n)
        steps += [
            {"name": f"miss{n}", "prompts": miss_prompts(spec, n, repeats), "max_tokens": 1,
             "reset_prefix_cache": True},
            {"name": f"prefix{n}", "prompt": p["P"], "max_tokens": 1, "repeat": repeats},
            {"name": f"P{n}", "prompt": p["P"], "max_tokens": OUTPUT_TOKENS, "fresh": True},
            {"name": f"Q{n}", "prompt": p["Q"], "max_tokens": OUTPUT_TOKENS},
        ]
    steps.append({"name": "reset", "prompt": [1], "max_tokens": 1, "reset_prefix_cache": True})
    for turn in session_turns(spec):
        steps.append({**turn, "max_tokens": OUTPUT_TOKENS})
    return steps


def connector_plan(lengths, spec, repeats: int, kvtier: bool, cases=CASES,
                   server_pid: int | None = None) -> list[dict]:
    """vLLM's prefix cache is on, and emptied before every step a hit must come from the
    connector. Per prompt length (kvtier: first the plain engine's misses, stored): P on a
    miss; P again from vLLM's own prefix cache (the reference for a hit of the same blocks);
    the first-token time of a connector hit; P and then Q (sharing P's first blocks) from
    the connector. ExampleConnector matches whole prompts only, so its engine serves Q's
    shared blocks from vLLM's prefix cache: the reference for kvtier's Q. Then a session's
    turns: through kvtier (``kvtier_session``), each from the connector; in the example
    engine, each from vLLM's prefix cache. Last (kvtier, ``server_pid``), per length a
    never-seen prompt while the server is hung."""
    steps = []
    for n in lengths:
        p = prompts(spec, n)
        if kvtier and "connector_miss" in cases:
            steps.append({"name": f"cmiss{n}", "prompts": miss_prompts(spec, n, repeats),
                          "max_tokens": 1, "reset_prefix_cache": True, "settle_s": 1.0})
        steps += [
            {"name": f"P{n}", "prompt": p["P"], "max_tokens": OUTPUT_TOKENS, "fresh": True,
             "settle_s": 1.0},
            {"name": f"Ppc{n}", "prompt": p["P"], "max_tokens": OUTPUT_TOKENS},
            {"name": f"hit{n}", "prompt": p["P"], "max_tokens": 1, "repeat": repeats,
             "reset_prefix_cache": True},
            {"name": f"Phit{n}", "prompt": p["P"], "max_tokens": OUTPUT_TOKENS,
             "reset_prefix_cache": True},
            {"name": f"Q{n}", "prompt": p["Q"], "max_tokens": OUTPUT_TOKENS,
             "reset_prefix_cache": kvtier, "settle_s": 1.0},
        ]
    steps.append({"name": "reset", "prompt": [1], "max_tokens": 1, "reset_prefix_cache": True})
    for turn in session_turns(spec):
        if kvtier:
            turn = {**turn, "kvtier_session": "chat-1", "reset_prefix_cache": True,
                    "settle_s": 1.0}
        steps.append({**turn, "max_tokens": OUTPUT_TOKENS})
    if kvtier and server_pid is not None and "hung" in cases:
        for n in lengths:
            steps.append({"name": f"hung{n}", "prompt": hung_prompt(spec, n), "max_tokens": 1,
                          "reset_prefix_cache": True,
                          "stop_server": {"pid": server_pid, "cap_s": HUNG_CAP_S}})
    return steps


def disk_plan(lengths, spec, repeats: int) -> list[dict]:
    """A fresh engine, its server's host tier too small for a chunk: P's hits from disk."""
    steps = []
    for n in lengths:
        p = prompts(spec, n)
        steps += [
            {"name": f"dhit{n}", "prompt": p["P"], "max_tokens": 1, "repeat": repeats,
             "reset_prefix_cache": True},
            {"name": f"Pdhit{n}", "prompt": p["P"], "max_tokens": OUTPUT_TOKENS,
             "reset_prefix_cache": True},
        ]
    return steps


def down_plan(lengths, spec, repeats: int) -> list[dict]:
    """An engine whose kvtier is down: the plain engine's steps up to its last misses, so
    each length's first miss follows the same requests in both engines."""
    steps = plain_plan(lengths, spec, repeats)
    last = max(i for i, s in enumerate(steps) if s["name"] == f"miss{lengths[-1]}")
    return steps[:last + 1]


def engine_env() -> dict[str, str]:
    # One reserved core for every engine, as vLLM gives one without a connector: with a
    # connector it reserves one more, which on a 2-core machine gives that engine's worker
    # every core (other threads, other rounding: see the docstring).
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
            "PYTHONPATH": str(ROOT)}


def run_engine(plan: dict, work: Path, name: str, timeout_s: float = ENGINE_TIMEOUT_S) -> dict:
    """The engine's result; one that did not start or did not finish in ``timeout_s`` is
    ``{"start_error": why, "steps": []}`` when the plan expects that (``may_fail``), and a
    ``RuntimeError`` otherwise."""
    path = work / f"{name}.json"
    path.write_text(json.dumps(plan))
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.vllm.engine", str(path)], cwd=ROOT,
                              env=engine_env(), capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        if plan.get("may_fail"):
            return {"start_error": f"no result within {timeout_s:.0f} s", "steps": []}
        raise RuntimeError(f"engine {name}: no result within {timeout_s:.0f} s") from exc
    log = proc.stdout + proc.stderr
    (work / f"{name}.log").write_text(log)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH-RESULT "):
            (work / f"{name}.result.json").write_text(line[len("BENCH-RESULT "):])
            result = json.loads(line[len("BENCH-RESULT "):])
            if result.get("start_error"):
                result["start_error"] += cause(log)
            return result
    if plan.get("may_fail"):
        return {"start_error": f"exit {proc.returncode}{cause(log)}", "steps": []}
    raise RuntimeError(f"engine {name} failed (exit {proc.returncode}): "
                       f"{(proc.stderr or proc.stdout)[-2000:]}")


def cause(log: str) -> str:
    """The first line of an engine's log that names why its worker failed, or a kvtier or
    gRPC error: vLLM's own message on a failed start ("Engine core initialization failed")
    does not."""
    for pattern in (r"Worker failed with error", r"kvstore\.format\.errors\.\w+:",
                    r"StatusCode\.|UNAVAILABLE"):
        for line in log.splitlines():
            if re.search(pattern, line):
                message = line.rsplit("] ", 1)[-1]  # past "(Worker pid=..) ERROR .. [..]"
                return f" (cause: {' '.join(message.split())[:300]})"
    return ""


def by_name(result: dict) -> dict[str, dict]:
    return {s["name"]: s for s in result["steps"] if "error" not in s}


def kvtier_connector(spec: vllm_models.LlamaSpec, target: str) -> dict:
    return {"kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"server": target, "tenant": TENANT,
                                          "model_fingerprint": f"{spec.name}-{spec.digest}"}}


def bench_model(key: str, lengths, repeats: int, work: Path, cases=CASES) -> dict:
    spec = MODELS[key]
    model = vllm_models.build(spec)
    max_len = max(8192, max(lengths) + 2 * OUTPUT_TOKENS)
    base = {"model": str(model), "max_model_len": max_len, "prefix_caching": True}
    runs = {"plain": run_engine({**base, "steps": plain_plan(lengths, spec, repeats)},
                                work, f"{key}-plain")}
    example_dir = work / f"{key}-example-store"
    runs["example"] = run_engine({**base, "connector": {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}},
        "warmup": False,  # its first timed step comes after untimed ones
        "steps": connector_plan(lengths, spec, repeats, kvtier=False)}, work, f"{key}-example")
    data = work / f"{key}-kvtier-data"
    with LiveServer(data, work, replay=False,
                    env={"KVTIER_HOST_BYTES": HOST_TIER, "KVTIER_DISK_BYTES": DISK_TIER}) as live:
        runs["kvtier"] = run_engine({**base, "connector": kvtier_connector(spec, live.target),
                                     "steps": connector_plan(lengths, spec, repeats, True, cases,
                                                             live.server.pid)},
                                    work, f"{key}-kvtier")
        stored = stored_bytes(live.target)
    memcpy = memcpy_gbps(per_load_bytes(runs["kvtier"].get("metrics", {})))
    if "disk" in cases:
        with LiveServer(data, work, replay=False,
                        env={"KVTIER_HOST_BYTES": TOO_SMALL_HOST_TIER,
                             "KVTIER_DISK_BYTES": DISK_TIER}) as live:
            runs["disk"] = run_engine({**base, "connector": kvtier_connector(spec, live.target),
                                       "steps": disk_plan(lengths, spec, repeats),
                                       "may_fail": True},
                                      work, f"{key}-kvtier-disk")
            stored_disk_server = stored_bytes(live.target)
        runs["disk"]["stored_bytes"] = stored_disk_server
    if "down" in cases:
        nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
        runs["down"] = run_engine({**base, "connector": kvtier_connector(spec, nowhere),
                                   "steps": down_plan(lengths, spec, repeats),
                                   "may_fail": True},
                                  work, f"{key}-kvtier-down", timeout_s=900)
    for name in ("plain", "example", "kvtier"):
        failed = [s for s in runs[name]["steps"] if "error" in s
                  and not s["name"].startswith("hung")]  # a hung server may kill an engine
        if failed:
            raise RuntimeError(f"engine {key}-{name}, step {failed[0]['name']}: "
                               f"{failed[0]['error']} (log in --work)")
    return summarize(key, spec, lengths, runs, stored, memcpy, cases)


def stored_bytes(target: str) -> dict[str, int]:
    """Bytes each tier of the server holds."""
    import kvtier

    with kvtier.Client(target) as client:
        stat = client.stat()
    return {t.name: t.used_bytes for t in stat.tiers}


def per_load_bytes(metrics: dict[str, float]) -> int:
    loads = metrics.get("kvtier_loads", 0.0)
    return int(metrics.get("kvtier_loaded_bytes", 0.0) / loads) if loads else 0


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float | None:
    """The best of ``repeats`` clones of an ``nbytes`` tensor, on one thread (the engine's
    worker has one), in GB/s."""
    if nbytes <= 0:
        return None
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = torch.ones(nbytes, dtype=torch.uint8)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            source.clone()
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best / 1e9


def _rate(metrics: dict[str, float], kind: str) -> float | None:
    """GB/s of the connector's loads (``kind`` "load") or saves ("save")."""
    seconds = metrics.get(f"kvtier_{kind}_seconds", 0.0)
    done = {"load": "loaded", "save": "saved"}[kind]
    return metrics.get(f"kvtier_{done}_bytes", 0.0) / seconds / 1e9 if seconds else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median(step: dict | None) -> float | None:
    return statistics.median(step["seconds"]) if step else None


def summarize(key, spec, lengths, runs: dict[str, dict], stored, memcpy, cases=CASES) -> dict:
    ref, ex, kv = by_name(runs["plain"]), by_name(runs["example"]), by_name(runs["kvtier"])
    disk = by_name(runs["disk"]) if "disk" in runs else {}
    down = by_name(runs["down"]) if "down" in runs else {}
    cases_out = []
    for n in lengths:
        same = {  # kvtier's output beside the one of the same KV from vLLM's own cache
            "miss": kv[f"P{n}"]["output"] == ex[f"P{n}"]["output"],
            "hit": kv[f"Phit{n}"]["output"] == kv[f"Ppc{n}"]["output"]
            == ex[f"Ppc{n}"]["output"] == ex[f"Phit{n}"]["output"],
            "shared_prefix": kv[f"Q{n}"]["output"] == ex[f"Q{n}"]["output"],
        }
        if f"Pdhit{n}" in disk:
            same["disk_hit"] = disk[f"Pdhit{n}"]["output"] == kv[f"Ppc{n}"]["output"]
        miss = _median(ref[f"miss{n}"])
        host_hit = _median(kv[f"hit{n}"])
        miss_connector = _median(kv.get(f"cmiss{n}"))
        hung = kv.get(f"hung{n}")
        hung_ttft = hung["seconds"][0] if hung else None
        # each engine's first miss at this length, after the same earlier requests
        first_miss = ref[f"miss{n}"]["seconds"][0]
        down_ttft = down[f"miss{n}"]["seconds"][0] if f"miss{n}" in down else None
        case = {
            "model": key, "prompt_tokens": n,
            "ttft_miss_s": miss,
            "ttft_miss_connector_s": miss_connector,
            "miss_connector_vs_miss": _ratio(miss_connector, miss),
            "ttft_kvtier_hit_s": host_hit,  # the host-tier hit, under its first name
            "ttft_kvtier_host_hit_s": host_hit,
            "ttft_kvtier_disk_hit_s": _median(disk.get(f"dhit{n}")),
            "ttft_example_hit_s": _median(ex[f"hit{n}"]),
            "ttft_prefix_cache_s": _median(ref[f"prefix{n}"]),
            "hung_server_ttft_s": hung_ttft,
            "hung_server_stall_s": (hung_ttft - miss_connector
                                    if hung_ttft is not None and miss_connector is not None
                                    else None),
            "hung_server_capped": hung["capped"] if hung else None,
            "ttft_first_miss_s": first_miss,
            "ttft_kvtier_down_s": down_ttft,
            "down_vs_miss": _ratio(down_ttft, first_miss),
            "ttft_miss_kvtier_down_s": _median(down.get(f"miss{n}")),
            "kvtier_cached_tokens": kv[f"hit{n}"]["num_cached_tokens"][-1],
            "disk_cached_tokens": (disk[f"dhit{n}"]["num_cached_tokens"][-1]
                                   if f"dhit{n}" in disk else None),
            "example_cached_tokens": ex[f"hit{n}"]["num_cached_tokens"][-1],
            "shared_prefix_cached_tokens": kv[f"Q{n}"]["num_cached_tokens"][-1],
            "identical_outputs": all(same.values()), "identical": same,
            "identical_to_no_connector_engine": {
                engine: all(e[f"{x}{n}"]["output"] == ref[f"{x}{n}"]["output"] for x in "PQ")
                for engine, e in (("kvtier", kv), ("example", ex))},
        }
        case["not_measured"] = not_measured(case, n, cases, runs)
        cases_out.append(case)
    m = runs["kvtier"].get("metrics", {})
    saved_tokens = m.get("kvtier_saved_tokens", 0.0)
    load, store = _rate(m, "load"), _rate(m, "save")
    return {
        "model": key, "layers": spec.layers, "cases": cases_out,
        "session": session(runs, ref, ex),
        "load_GBps": load, "store_GBps": store, "memcpy_GBps": memcpy,
        "load_vs_memcpy": _ratio(load, memcpy), "store_vs_memcpy": _ratio(store, memcpy),
        "memcpy_bytes": per_load_bytes(m),
        "disk_load_GBps": _rate(runs["disk"].get("metrics", {}), "load")
        if "disk" in runs else None,
        "bytes_per_token": stored.get("disk", 0) / saved_tokens if saved_tokens else None,
        "metrics": m, "stored_bytes": stored,
        "disk_server_stored_bytes": runs["disk"].get("stored_bytes") if "disk" in runs else None,
        "down_engine": ({"start_s": runs["down"].get("start_s"),
                         "start_error": runs["down"].get("start_error")}
                        if "down" in runs else None),
        "step_errors": {name: s["error"] for name, r in runs.items()
                        for s in r["steps"] if "error" in s},
        "engine_start_s": {name: r.get("start_s") for name, r in runs.items()},
    }


def not_measured(case: dict, n: int, cases, runs: dict[str, dict]) -> dict[str, str]:
    """Why each of the user-pays keys of a case is null."""
    why = {}
    for key, name, engine in (("ttft_miss_connector_s", "connector_miss", "kvtier"),
                              ("hung_server_stall_s", "hung", "kvtier"),
                              ("ttft_kvtier_disk_hit_s", "disk", "disk"),
                              ("ttft_kvtier_down_s", "down", "down")):
        if case[key] is not None:
            continue
        run = runs.get(engine)
        if name not in cases:
            why[key] = f"not run at this size (--cases without {name})"
        elif run and run.get("start_error"):
            why[key] = f"the engine did not start: {run['start_error']}"
        else:
            errors = [s["error"] for s in (run or {}).get("steps", []) if "error" in s]
            why[key] = f"the step failed: {errors[0]}" if errors else \
                "a case it needs was not measured"
    return why


def session(runs: dict[str, dict], ref: dict, ex: dict) -> dict:
    """The session's turns through kvtier beside the example engine's (the reference) and
    the plain engine's. Each turn's prompt is the previous turn's prompt and its engine's
    own answer, so once two engines' answers differ, their later turns are other prompts:
    ``first_divergence_from_no_connector`` is where they first part, in (turn, token)."""
    turns = [s for s in runs["kvtier"]["steps"] if s["name"].startswith("turn")
             and "error" not in s]
    divergence = None
    for i, turn in enumerate(turns, 1):
        at = first_difference(turn["output"], ref[turn["name"]]["output"])
        if at is not None:
            divergence = {"turn": i, "token": at}
            break
    return {"turns": len(turns),
            "identical_outputs": all(t["output"] == ex[t["name"]]["output"] for t in turns),
            "identical_per_turn": [t["output"] == ex[t["name"]]["output"] for t in turns],
            "identical_to_no_connector_engine_per_turn":
                [t["output"] == ref[t["name"]]["output"] for t in turns],
            "first_divergence_from_no_connector": divergence,
            "cached_tokens": [t["num_cached_tokens"][-1] for t in turns],
            "reference_cached_tokens": [ex[t["name"]]["num_cached_tokens"][-1] for t in turns]}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a shorter one differs at its end)."""
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return at if at is not None or len(a) == len(b) else min(len(a), len(b))


def headline(models: list[dict]) -> dict:
    """The largest prompt of the last model: the figures the goals name."""
    last = models[-1]
    case = max(last["cases"], key=lambda c: c["prompt_tokens"])
    keys = ("ttft_miss_s", "ttft_miss_connector_s", "ttft_kvtier_hit_s",
            "ttft_kvtier_host_hit_s", "ttft_kvtier_disk_hit_s", "ttft_example_hit_s",
            "ttft_prefix_cache_s", "hung_server_stall_s", "hung_server_capped",
            "ttft_first_miss_s", "ttft_kvtier_down_s", "ttft_miss_kvtier_down_s",
            "miss_connector_vs_miss", "down_vs_miss")
    out = {k: case[k] for k in keys}
    out["identical_outputs"] = all(c["identical_outputs"] for m in models for c in m["cases"]) \
        and all(m["session"]["identical_outputs"] for m in models)
    for k in ("load_GBps", "store_GBps", "memcpy_GBps", "load_vs_memcpy", "store_vs_memcpy",
              "bytes_per_token"):
        out[k] = last[k]
    out["kvtier_hit_vs_miss"] = _ratio(case["ttft_kvtier_hit_s"], case["ttft_miss_s"])
    out["kvtier_hit_vs_example_hit"] = _ratio(case["ttft_kvtier_hit_s"],
                                              case["ttft_example_hit_s"])
    out["host_hit_vs_example_hit"] = out["kvtier_hit_vs_example_hit"]
    out["host_hit_vs_prefix_cache"] = _ratio(case["ttft_kvtier_host_hit_s"],
                                             case["ttft_prefix_cache_s"])
    out["disk_hit_vs_example_hit"] = _ratio(case["ttft_kvtier_disk_hit_s"],
                                            case["ttft_example_hit_s"])
    out["headline_case"] = f"{last['model']} model, {case['prompt_tokens']} tokens"
    out["goal"] = goal(out)
    return out


def goal(values: dict) -> dict:
    """Each goal of the issue: the headline's value, its limit, and whether it is met (None:
    not measured); ``identical_outputs`` is one too."""
    out = {}
    for key, sense, limit in GOALS:
        value = values.get(key)
        met = None if value is None else (value <= limit if sense == "<=" else value >= limit)
        out[key] = {"value": value, "limit": f"{sense} {limit}", "met": met}
    out["identical_outputs"] = {"value": values["identical_outputs"], "limit": "== True",
                                "met": values["identical_outputs"]}
    out["all_met"] = all(g["met"] for g in out.values())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--models", default="tiny,mid")
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"optional measurements, of {','.join(CASES)} ('' for none)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="model kinds for stored_vs_own_cache (bench.vllm.kinds; '' "
                        "for none)")
    parser.add_argument("--kind-length", type=int, default=1074,
                        help="the kinds' prompt length")
    parser.add_argument("--work", type=Path, help="keep the engines' plans, logs and results "
                        "here (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    cases = tuple(c for c in args.cases.split(",") if c)
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {list(CASES)}")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        models = [bench_model(k, lengths, args.repeats, work, cases)
                  for k in args.models.split(",") if k]
        kinds = [bench_kind(k, args.kind_length, args.repeats, work, run_engine,
                            kvtier_connector)
                 for k in args.kinds.split(",") if k]
    result = {**(headline(models) if models else {}), "models": models, "kinds": kinds,
              "stored_vs_own_cache": {k["kind"]: k["stored_vs_own_cache"] for k in kinds},
              "identical_per_kind": {k["kind"]: k["identical"] for k in kinds}}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for m in models:
            for c in m["cases"]:
                print(f"{m['model']:>5} {c['prompt_tokens']:>5} tokens: "
                      + ", ".join(f"{k} {_fmt(c[k])}" for k in (
                          "ttft_miss_s", "ttft_miss_connector_s", "ttft_kvtier_host_hit_s",
                          "ttft_kvtier_disk_hit_s", "ttft_example_hit_s",
                          "ttft_prefix_cache_s", "hung_server_stall_s",
                          "ttft_kvtier_down_s", "identical_outputs")))
        for k in kinds:
            print(f"{k['kind']:>8} {k['prompt_tokens']} tokens: stored/own "
                  f"{_fmt(k['stored_vs_own_cache'])}, kvtier hit {_fmt(k['ttft_kvtier_hit_s'])}"
                  f" s, prefix cache {_fmt(k['ttft_prefix_cache_s'])} s, identical "
                  f"{k['identical']}")
        print({k: v for k, v in result.items() if k not in ("models", "goal", "kinds")})
        if models:
            print({k: g if k == "all_met" else g["met"] for k, g in result["goal"].items()})
    return 0


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
