"""DeepSeek-V4.1's bounded replay through KVTierConnector on a CUDA GPU (the GPU script's
vLLM section, ../shared/GPU.md).

``python -m bench.vllm.dsv41_replay --out REPORT.json [--prompt-tokens 1024]``

Needs CUDA and vLLM's CUDA build (0.32: ``SlidingWindowMLASpec(bounded_replay=True)`` and
the scheduler's ``prefix_replay_tokens``); where either is missing it writes a report whose
``status`` is ``skipped``, with the reason, and exits 0: vLLM has no CPU path for
``DeepseekV41ForCausalLM``. A tiny DeepSeek-V4.1 (``testing.vllm_models``: 3 layers with
compress ratios 0/2/1, parameters drawn from seeds) runs in two engines, one after another
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the scheduler can be watched):

- reference: no connector; each prompt's greedy tokens and top-k logprobs;
- kvtier: KVTierConnector against a kvtier server (a child process, ``testing.live_server``);
  each prompt once (a miss: its global groups are stored), then, with vLLM's prefix cache
  reset, again: a hit from kvtier. The scheduler's ``_mark_prefix_replay`` is watched, so
  the report says per request whether the window came with the load (``window_loaded``)
  or how many tokens the engine replayed (``replay_tokens``, ``min(window, hit)``).

The report: the engines' KV cache groups (kind, block size, page bytes, window,
``bounded_replay``), ``prefix_replay_tokens``, per prompt the hit's ``num_cached_tokens``,
the replay seen, whether the greedy tokens agree with the reference and the largest top-k
logprob difference; ``status`` ``ok`` when every hit loaded, replayed as the scheduler's
rules say and agreed, ``failed`` otherwise, ``error`` (with the message) when an engine did
not run. Exit status 1 unless ``ok`` or ``skipped``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.vllm.engine import connector_metrics, reset_prefix_cache
from testing import vllm_models

TENANT = "dsv41-replay"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the report (JSON)")
    parser.add_argument("--prompt-tokens", type=int, default=1024,
                        help="tokens per prompt (hits are whole blocks of it)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts, each missed then hit")
    parser.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per request")
    parser.add_argument("--logprobs", type=int, default=5, help="top-k logprobs compared")
    parser.add_argument("--logprob-tol", type=float, default=0.05,
                        help="largest top-k logprob difference a hit may show (bf16 "
                             "kernels split the work differently on a hit)")
    parser.add_argument("--model-root", type=Path, default=None,
                        help="where the model's config goes (default: a temporary folder)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--settle-s", type=float, default=5.0,
                        help="seconds the connector's background saves get before the hits")
    args = parser.parse_args(argv)
    if args.prompt_tokens < 2 or args.prompts < 1 or args.max_tokens < 1:
        parser.error("--prompt-tokens must be at least 2, --prompts and --max-tokens at least 1")
    return args


def missing_requirement() -> str | None:
    """Why this machine cannot run the check, or None."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    # the kvtier server and client need these; the device image lacks them (carry wheels)
    missing = [m for m in ("zstandard", "lmdb") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{', '.join(missing)} not importable; carry cp312 wheels (../shared/GPU.md)"
    try:
        from vllm.v1.kv_cache_interface import SlidingWindowMLASpec
    except ImportError as exc:
        return f"vLLM is not importable ({exc}); carry its CUDA build (../shared/GPU.md)"
    if "bounded_replay" not in SlidingWindowMLASpec.__dataclass_fields__:
        return "this vLLM has no SWA bounded replay (SlidingWindowMLASpec.bounded_replay)"
    return None


def judge(report: dict, logprob_tol: float) -> str:
    """``ok`` when every hit loaded from kvtier, replayed what the scheduler's rules say
    (nothing when the window came with the load, else ``min(window, hit)``) and agreed with
    the reference; ``failed`` otherwise."""
    window = report.get("prefix_replay_tokens", 0)
    for hit in report["hits"]:
        if hit["num_cached_tokens"] <= 0 or not hit["tokens_agree"]:
            return "failed"
        if hit["max_logprob_diff"] > logprob_tol:
            return "failed"
        replay = hit.get("replay")
        if window and replay is None:
            return "failed"  # the scheduler never marked the hit
        if replay is not None:
            want = 0 if replay["window_loaded"] else min(window, replay["hit_tokens"])
            if replay["replay_tokens"] != want:
                return "failed"
    return "ok"


def max_logprob_diff(got: list[dict], want: list[dict]) -> float:
    """The largest difference of a token's logprob over the steps where both list it; inf
    when a step shares no token or the steps differ in number."""
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        shared = set(a) & set(b)
        if not shared:
            return float("inf")
        worst = max(worst, max(abs(a[t] - b[t]) for t in shared))
    return worst


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the engine core in this process, so its scheduler can be watched (set before vLLM
    # reads its settings)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    report: dict = {"check": "dsv41_bounded_replay", "status": "skipped"}
    reason = missing_requirement()
    if reason is not None:
        report["reason"] = reason
        write_report(args.out, report)
        print(f"dsv41_replay: skipped: {reason}")
        return 0
    try:
        report.update(run(args))
        report["status"] = judge(report, args.logprob_tol)
    except Exception as exc:  # an engine that does not start on this device: say why
        report.update(status="error", error=f"{type(exc).__name__}: {exc}")
    write_report(args.out, report)
    print(f"dsv41_replay: {report['status']}")
    return 0 if report["status"] == "ok" else 1


def run(args: argparse.Namespace) -> dict:
    from testing.live_server import LiveServer

    rng = random.Random(0)
    vocab = vllm_models.DEEPSEEK_V41_TEXT["vocab_size"]
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_tokens)]
               for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="dsv41-") as scratch:
        root = args.model_root or Path(scratch) / "models"
        model = vllm_models.config_dir(vllm_models.deepseek_v41_config(), "tiny-dsv41", root)
        vllm_models.register_seeded_loader()
        reference = _engine(args, model, None)
        want = [_generate(reference["llm"], p, args) for p in prompts]
        _close(reference)
        with LiveServer(Path(scratch) / "data", Path(scratch) / "logs", replay=False) as live:
            extra = {"server": live.target, "tenant": TENANT, "timeout_s": 60,
                     "model_fingerprint": vllm_models.config_fingerprint(model),
                     "lookup_timeout_ms": 10000}
            engine = _engine(args, model, extra)
            marks = _watch_replay(engine["scheduler"])
            for p in prompts:
                _generate(engine["llm"], p, args)
            time.sleep(args.settle_s)  # the background writer lands the last saves
            hits = []
            for p, reference_out in zip(prompts, want, strict=True):
                if not reset_prefix_cache(engine["llm"]):
                    raise RuntimeError("vLLM's prefix cache could not be reset")
                marks.clear()
                got = _generate(engine["llm"], p, args)
                hits.append({
                    "num_cached_tokens": got["num_cached_tokens"],
                    "kv_transfer_params": got["kv_transfer_params"],
                    "replay": marks[-1] if marks else None,
                    "tokens_agree": got["tokens"] == reference_out["tokens"],
                    "max_logprob_diff": max_logprob_diff(got["logprobs"],
                                                         reference_out["logprobs"]),
                    "seconds": got["seconds"]})
            result = {"groups": engine["groups"], "start_s": engine["start_s"],
                      "reference_start_s": reference["start_s"],
                      "prefix_replay_tokens": engine["scheduler"].prefix_replay_tokens,
                      "hits": hits, "connector": connector_metrics()}
            _close(engine)
    return result


def _engine(args: argparse.Namespace, model: Path, kvtier: dict | None) -> dict:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None if kvtier is None else KVTransferConfig(
        kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config=kvtier)
    started = time.monotonic()
    llm = LLM(model=str(model), load_format=vllm_models.SEEDED_LOAD_FORMAT, dtype="bfloat16",
              max_model_len=4 * args.prompt_tokens, enforce_eager=True,
              skip_tokenizer_init=True, seed=0, kv_transfer_config=transfer,
              gpu_memory_utilization=args.gpu_memory_utilization,
              disable_log_stats=False)  # the connector's counters (connector_metrics)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    groups = [{"spec": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
               "page_size_bytes": g.kv_cache_spec.page_size_bytes,
               "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
               "bounded_replay": getattr(g.kv_cache_spec, "bounded_replay", None),
               "layers": list(g.layer_names)}
              for g in scheduler.kv_cache_config.kv_cache_groups]
    return {"llm": llm, "scheduler": scheduler, "groups": groups,
            "start_s": time.monotonic() - started}


def _watch_replay(scheduler) -> list[dict]:
    """Records each of the scheduler's replay decisions: the hit, whether the connector's
    load carried the window, the tokens it rewinds to replay."""
    marks: list[dict] = []
    original = scheduler._mark_prefix_replay

    def mark(request, num_hit_tokens: int, window_loaded: bool) -> int:
        replayed = original(request, num_hit_tokens, window_loaded)
        marks.append({"request": request.request_id, "hit_tokens": num_hit_tokens,
                      "window_loaded": window_loaded, "replay_tokens": replayed})
        return replayed

    scheduler._mark_prefix_replay = mark
    return marks


def _generate(llm, tokens: list[int], args: argparse.Namespace) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False,
                            logprobs=args.logprobs)
    began = time.monotonic()
    (reply,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    out = reply.outputs[0]
    return {"tokens": list(out.token_ids), "num_cached_tokens": reply.num_cached_tokens,
            "kv_transfer_params": reply.kv_transfer_params,
            "logprobs": [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs],
            "seconds": time.monotonic() - began}


def _close(engine: dict) -> None:
    import gc

    import torch

    engine.pop("llm", None)
    engine.pop("scheduler", None)
    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
