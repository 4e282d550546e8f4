"""kvtier inside vLLM's CPU build, side by side with vLLM's own caches, in one run.

``python -m bench.vllm [--json] [--models tiny,mid] [--lengths 1024,4096]`` (in .venv-vllm:
``make vllm``). For each model (``testing.vllm_models``: seeded random Llamas saved locally)
three engines run one after another, each in its own child process (``bench.vllm.engine``):

- plain: no connector, vLLM's prefix cache on. Per prompt length: the first-token time on a
  miss (``ttft_miss_s``), then on vLLM's own prefix-cache hit (``ttft_prefix_cache_s``: the
  in-memory ceiling), and the greedy outputs every other engine must reproduce.
- kvtier: ``KVTierConnector`` against a live kvtier server (its own process): the prompt
  stored on a miss, then its first-token time on a kvtier hit (``ttft_kvtier_hit_s``), a
  second prompt sharing its prefix, and a three-turn session (``kvtier_session``) resumed
  turn after turn; vLLM's prefix cache is emptied before each step a hit must come from
  kvtier (``connector_plan``).
- example: vLLM's ``ExampleConnector`` (safetensors files), the same way
  (``ttft_example_hit_s``), and the references below.

``identical_outputs``: kvtier's greedy outputs equal those the engine gives from the same KV
held in vLLM's own prefix cache (same blocks cached, same tokens computed): a miss equals the
example engine's miss, a kvtier hit of P equals P served from vLLM's prefix cache, the
shared-prefix prompt equals the example engine's (its shared blocks from vLLM's cache), and
each session turn equals the example engine's turn (the earlier turns' blocks from vLLM's
cache). Bit-exact KV gives exactly these; a wrong block would not. The outputs of an engine
without any connector are reported beside them (``identical_to_no_connector_engine``):
vLLM computes a little differently once a connector is configured (ExampleConnector's
misses differ from the plain engine's as kvtier's do), and a prefix-cache hit differs from
a full prefill of the same prompt on these random-weight models, so neither is the
reference. ``load_GBps``/``store_GBps`` come from the connector's counters (bytes and
seconds of its loads and saves), ``bytes_per_token`` from the server's disk tier over the
tokens the connector stored. Times are medians of ``--repeats`` runs (hits; a miss is run
once per length).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from testing import vllm_models
from testing.live_server import LiveServer

ROOT = Path(__file__).resolve().parent.parent.parent
OUTPUT_TOKENS = 32
MODELS = {"tiny": vllm_models.TINY, "mid": vllm_models.MID}
TENANT = "bench"


def prompts(spec: vllm_models.LlamaSpec, length: int) -> dict[str, list[int]]:
    """A prompt of ``length`` tokens and a second one sharing its first three quarters."""
    shared = vllm_models.prompt(spec, length * 3 // 4, seed=length)
    return {"P": shared + vllm_models.prompt(spec, length - len(shared), seed=length + 1),
            "Q": shared + vllm_models.prompt(spec, length - len(shared), seed=length + 2)}


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
            {"name": f"miss{n}", "prompt": p["P"], "max_tokens": 1, "reset_prefix_cache": True},
            {"name": f"prefix{n}", "prompt": p["P"], "max_tokens": 1, "repeat": repeats},
            {"name": f"P{n}", "prompt": p["P"], "max_tokens": OUTPUT_TOKENS, "fresh": True},
            {"name": f"Q{n}", "prompt": p["Q"], "max_tokens": OUTPUT_TOKENS},
        ]
    steps.append({"name": "reset", "prompt": [1], "max_tokens": 1, "reset_prefix_cache": True})
    for turn in session_turns(spec):
        steps.append({**turn, "max_tokens": OUTPUT_TOKENS})
    return steps


def connector_plan(lengths, spec, repeats: int, kvtier: bool) -> list[dict]:
    """vLLM's prefix cache is on, and emptied before every step a hit must come from the
    connector. Per prompt length: P on a miss; P again from vLLM's own prefix cache (the
    reference for a hit of the same blocks); the first-token time of a connector hit; P and
    then Q (sharing P's first blocks) from the connector. ExampleConnector matches whole
    prompts only, so its engine serves Q's shared blocks from vLLM's prefix cache: the
    reference for kvtier's Q. Then a session's turns: through kvtier (``kvtier_session``),
    each from the connector; in the example engine, each from vLLM's prefix cache."""
    steps = []
    for n in lengths:
        p = prompts(spec, n)
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
    return steps


def run_engine(plan: dict, work: Path, name: str) -> dict:
    path = work / f"{name}.json"
    path.write_text(json.dumps(plan))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.vllm.engine", str(path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=3600)
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH-RESULT "):
            (work / f"{name}.result.json").write_text(line[len("BENCH-RESULT "):])
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH-RESULT "):
            return json.loads(line[len("BENCH-RESULT "):])
    raise RuntimeError(f"engine {name} failed (exit {proc.returncode}): "
                       f"{(proc.stderr or proc.stdout)[-2000:]}")


def by_name(result: dict) -> dict[str, dict]:
    return {s["name"]: s for s in result["steps"]}


def bench_model(key: str, lengths, repeats: int, work: Path) -> dict:
    spec = MODELS[key]
    model = vllm_models.build(spec)
    max_len = max(8192, max(lengths) + 2 * OUTPUT_TOKENS)
    base = {"model": str(model), "max_model_len": max_len, "prefix_caching": True}
    plain = run_engine({**base,
                        "steps": plain_plan(lengths, spec, repeats)}, work, f"{key}-plain")
    example_dir = work / f"{key}-example-store"
    example = run_engine({**base, "connector": {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}},
        "steps": connector_plan(lengths, spec, repeats, kvtier=False)}, work, f"{key}-example")
    with LiveServer(work / f"{key}-kvtier-data", work, replay=False,
                    env={"KVTIER_HOST_BYTES": str(4 << 30)}) as live:
        kvt = run_engine({**base, "connector": {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"server": live.target, "tenant": TENANT,
                                          "model_fingerprint": f"{spec.name}-{spec.digest}"}},
            "steps": connector_plan(lengths, spec, repeats, kvtier=True)}, work, f"{key}-kvtier")
        stored = stored_bytes(live.target)
    return summarize(key, spec, lengths, plain, example, kvt, stored)


def stored_bytes(target: str) -> dict[str, int]:
    """Bytes each durable tier of the server holds."""
    import kvtier

    with kvtier.Client(target) as client:
        stat = client.stat()
    return {t.name: t.used_bytes for t in stat.tiers}


def summarize(key, spec, lengths, plain, example, kvt, stored) -> dict:
    ref, ex, kv = by_name(plain), by_name(example), by_name(kvt)
    median = statistics.median
    cases = []
    for n in lengths:
        same = {  # kvtier's output beside the one of the same KV from vLLM's own cache
            "miss": kv[f"P{n}"]["output"] == ex[f"P{n}"]["output"],
            "hit": kv[f"Phit{n}"]["output"] == kv[f"Ppc{n}"]["output"]
            == ex[f"Ppc{n}"]["output"] == ex[f"Phit{n}"]["output"],
            "shared_prefix": kv[f"Q{n}"]["output"] == ex[f"Q{n}"]["output"],
        }
        cases.append({
            "model": key, "prompt_tokens": n,
            "ttft_miss_s": ref[f"miss{n}"]["seconds"][0],
            "ttft_kvtier_hit_s": median(kv[f"hit{n}"]["seconds"]),
            "ttft_example_hit_s": median(ex[f"hit{n}"]["seconds"]),
            "ttft_prefix_cache_s": median(ref[f"prefix{n}"]["seconds"]),
            "kvtier_cached_tokens": kv[f"hit{n}"]["num_cached_tokens"][-1],
            "example_cached_tokens": ex[f"hit{n}"]["num_cached_tokens"][-1],
            "shared_prefix_cached_tokens": kv[f"Q{n}"]["num_cached_tokens"][-1],
            "identical_outputs": all(same.values()), "identical": same,
            "identical_to_no_connector_engine": {
                engine: all(e[f"{x}{n}"]["output"] == ref[f"{x}{n}"]["output"] for x in "PQ")
                for engine, e in (("kvtier", kv), ("example", ex))},
        })
    turns = [s for s in kvt["steps"] if s["name"].startswith("turn")]
    session_same = [t["output"] == ex[t["name"]]["output"] for t in turns]
    no_connector_same = [t["output"] == ref[t["name"]]["output"] for t in turns]
    m = kvt["metrics"]
    load_s, store_s = m.get("kvtier_load_seconds", 0.0), m.get("kvtier_save_seconds", 0.0)
    saved_tokens = m.get("kvtier_saved_tokens", 0.0)
    durable = stored.get("disk", 0)
    return {
        "model": key, "layers": spec.layers, "cases": cases,
        "session": {"turns": len(turns), "identical_outputs": all(session_same),
                    "identical_per_turn": session_same,
                    "identical_to_no_connector_engine_per_turn": no_connector_same,
                    "cached_tokens": [t["num_cached_tokens"][-1] for t in turns],
                    "reference_cached_tokens": [ex[t["name"]]["num_cached_tokens"][-1]
                                                for t in turns]},
        "load_GBps": m.get("kvtier_loaded_bytes", 0.0) / load_s / 1e9 if load_s else None,
        "store_GBps": m.get("kvtier_saved_bytes", 0.0) / store_s / 1e9 if store_s else None,
        "bytes_per_token": durable / saved_tokens if saved_tokens else None,
        "metrics": m, "stored_bytes": stored,
        "engine_start_s": {"plain": plain["start_s"], "example": example["start_s"],
                           "kvtier": kvt["start_s"]},
    }


def headline(models: list[dict]) -> dict:
    """The largest prompt of the last model: the figures the goals name."""
    last = models[-1]
    case = max(last["cases"], key=lambda c: c["prompt_tokens"])
    keys = ("ttft_miss_s", "ttft_kvtier_hit_s", "ttft_example_hit_s", "ttft_prefix_cache_s")
    out = {k: case[k] for k in keys}
    out["identical_outputs"] = all(c["identical_outputs"] for m in models for c in m["cases"]) \
        and all(m["session"]["identical_outputs"] for m in models)
    for k in ("load_GBps", "store_GBps", "bytes_per_token"):
        out[k] = last[k]
    out["kvtier_hit_vs_miss"] = case["ttft_kvtier_hit_s"] / case["ttft_miss_s"]
    out["kvtier_hit_vs_example_hit"] = case["ttft_kvtier_hit_s"] / case["ttft_example_hit_s"]
    out["headline_case"] = f"{last['model']} model, {case['prompt_tokens']} tokens"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--models", default="tiny,mid")
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, help="keep the engines' plans, logs and results "
                        "here (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        models = [bench_model(k, lengths, args.repeats, work) for k in args.models.split(",")]
    result = {**headline(models), "models": models}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for m in models:
            for c in m["cases"]:
                print(f"{m['model']:>5} {c['prompt_tokens']:>5} tokens: miss "
                      f"{c['ttft_miss_s']:.3f} s, kvtier hit {c['ttft_kvtier_hit_s']:.3f} s, "
                      f"example hit {c['ttft_example_hit_s']:.3f} s, prefix cache "
                      f"{c['ttft_prefix_cache_s']:.3f} s, identical {c['identical_outputs']}")
        print({k: v for k, v in result.items() if k != "models"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
