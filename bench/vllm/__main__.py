"""kvtier inside vLLM's CPU build, side by side with vLLM's own caches, in one run.

``python -m bench.vllm [--json] [--models tiny,mid] [--lengths 1024,4096]`` (in .venv-vllm:
``make vllm``). For each model (``testing.vllm_models``: seeded random Llamas saved locally)
three engines run one after another, each in its own child process (``bench.vllm.engine``):

- plain: no connector, vLLM's prefix cache on. Per prompt length: the first-token time on a
  miss (``ttft_miss_s``), then on vLLM's own prefix-cache hit (``ttft_prefix_cache_s``: the
  in-memory ceiling), and the greedy outputs every other engine must reproduce.
- kvtier: ``KVTierConnector`` against a live kvtier server (its own process), vLLM's prefix
  cache off, so every hit comes through kvtier: the prompt is stored on a miss, then its
  first-token time on a kvtier hit (``ttft_kvtier_hit_s``), a second prompt sharing its prefix,
  and a three-turn session (``kvtier_session``) resumed turn after turn.
- example: vLLM's ``ExampleConnector`` (safetensors files), the same way
  (``ttft_example_hit_s``).

``identical_outputs``: every greedy output of the connector engines equals the plain engine's
for the same prompt. ``load_GBps``/``store_GBps``/``bytes_per_token`` come from the
connector's metrics (bytes and seconds of its loads and saves) and the server's tiers. Times
are medians of ``--repeats`` runs (hits; a miss is run once per length, after a reset).
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


def plain_plan(model: Path, lengths, spec, repeats: int) -> list[dict]:
    steps = []
    for n in lengths:
        p = prompts(spec, n)
        steps += [
            {"name": f"miss{n}", "prompt": p["P"], "max_tokens": 1, "reset_prefix_cache": True},
            {"name": f"prefix{n}", "prompt": p["P"], "max_tokens": 1, "repeat": repeats},
            {"name": f"P{n}", "prompt": p["P"], "max_tokens": OUTPUT_TOKENS,
             "reset_prefix_cache": True},
            {"name": f"Q{n}", "prompt": p["Q"], "max_tokens": OUTPUT_TOKENS,
             "reset_prefix_cache": True},
        ]
    # A session's turns as vLLM serves them by default: each turn's prompt blocks from its
    # own prefix cache (the reference), and once more from a full prefill each turn.
    steps.append({"name": "reset", "prompt": [1], "max_tokens": 1, "reset_prefix_cache": True})
    for turn in session_turns(spec):
        steps.append({**turn, "max_tokens": OUTPUT_TOKENS})
    for turn in session_turns(spec, "full"):
        steps.append({**turn, "max_tokens": OUTPUT_TOKENS, "reset_prefix_cache": True})
    return steps


def connector_plan(lengths, spec, repeats: int, sessions: bool) -> list[dict]:
    steps = []
    for n in lengths:
        p = prompts(spec, n)
        steps += [
            {"name": f"P{n}", "prompt": p["P"], "max_tokens": OUTPUT_TOKENS, "settle_s": 1.0},
            {"name": f"hit{n}", "prompt": p["P"], "max_tokens": 1, "repeat": repeats},
            {"name": f"Phit{n}", "prompt": p["P"], "max_tokens": OUTPUT_TOKENS},
            {"name": f"Q{n}", "prompt": p["Q"], "max_tokens": OUTPUT_TOKENS, "settle_s": 1.0},
        ]
    if sessions:
        for turn in session_turns(spec):
            steps.append({**turn, "max_tokens": OUTPUT_TOKENS, "kvtier_session": "chat-1",
                          "settle_s": 1.0})
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
    base = {"model": str(model), "max_model_len": max_len}
    plain = run_engine({**base, "prefix_caching": True,
                        "steps": plain_plan(model, lengths, spec, repeats)}, work, f"{key}-plain")
    example_dir = work / f"{key}-example-store"
    example = run_engine({**base, "prefix_caching": False, "connector": {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(example_dir)}},
        "steps": connector_plan(lengths, spec, repeats, sessions=False)}, work, f"{key}-example")
    with LiveServer(work / f"{key}-kvtier-data", work, replay=False,
                    env={"KVTIER_HOST_BYTES": str(4 << 30)}) as live:
        kvt = run_engine({**base, "prefix_caching": False, "connector": {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"server": live.target, "tenant": TENANT,
                                          "model_fingerprint": f"{spec.name}-{spec.digest}"}},
            "steps": connector_plan(lengths, spec, repeats, sessions=True)}, work, f"{key}-kvtier")
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
        same = all(engine[name]["output"] == ref[f"{name[0]}{n}"]["output"]
                   for engine in (ex, kv) for name in (f"P{n}", f"Phit{n}", f"Q{n}"))
        cases.append({
            "model": key, "prompt_tokens": n,
            "ttft_miss_s": ref[f"miss{n}"]["seconds"][0],
            "ttft_kvtier_hit_s": median(kv[f"hit{n}"]["seconds"]),
            "ttft_example_hit_s": median(ex[f"hit{n}"]["seconds"]),
            "ttft_prefix_cache_s": median(ref[f"prefix{n}"]["seconds"]),
            "kvtier_cached_tokens": kv[f"hit{n}"]["num_cached_tokens"][-1],
            "example_cached_tokens": ex[f"hit{n}"]["num_cached_tokens"][-1],
            "shared_prefix_cached_tokens": kv[f"Q{n}"]["num_cached_tokens"][-1],
            "identical_outputs": same,
        })
    turns = [s for s in kvt["steps"] if s["name"].startswith("turn")]
    session_same = all(t["output"] == ref[t["name"]]["output"] for t in turns)
    full_same = [t["output"] == ref[f"full{t['name'][4:]}"]["output"] for t in turns]
    m = kvt["metrics"]
    load_s, store_s = m.get("kvtier_load_seconds", 0.0), m.get("kvtier_save_seconds", 0.0)
    saved_tokens = m.get("kvtier_saved_tokens", 0.0)
    durable = stored.get("disk", 0)
    return {
        "model": key, "layers": spec.layers, "cases": cases,
        "session": {"turns": len(turns), "identical_outputs": session_same,
                    "identical_to_full_prefill_per_turn": full_same,
                    "prefix_cache_identical_to_full_prefill_per_turn": [
                        ref[f"turn{n}"]["output"] == ref[f"full{n}"]["output"]
                        for n in range(1, len(turns) + 1)],
                    "cached_tokens": [t["num_cached_tokens"][-1] for t in turns]},
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
