"""What kvtier stores per kind of model inside vLLM, against the engine's own cache: a
full-attention model (``testing.vllm_models.TINY``), a hybrid one (Gemma3-like: sliding
layers with a 128-token window and a full layer) and an all-sliding Mistral
(``testing.vllm_hybrid``). For each kind one engine with ``KVTierConnector`` against a
live kvtier server (host RAM holds everything): a never-seen prompt (stored), vLLM's own
prefix-cache hit of it, then hits from kvtier with vLLM's cache emptied before each.

Per kind:
- ``stored_vs_own_cache``: the bytes kvtier holds for the prompt (every chunk of every
  group's layout, headers included) over the bytes the engine's own cache holds for the
  same tokens after it (a full group's every block; a sliding group's blocks of its
  window, those vLLM has not replaced by null blocks), and the same per group
  (``groups``: bytes per token of each, stored and own);
- ``ttft_kvtier_hit_s`` and ``ttft_prefix_cache_s``: first-token times (medians) of a hit
  from kvtier and from vLLM's own cache;
- ``identical``: the kvtier hit's greedy tokens and top-5 logprobs equal vLLM's own
  prefix-cache hit's (random weights repeat one token: the logprobs tell).
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from testing import vllm_hybrid, vllm_models
from testing.live_server import LiveServer

TENANT = "bench-kinds"
BS = 128  # vLLM's block size on the CPU
KINDS = {"full": vllm_models.TINY, "hybrid": vllm_hybrid.GEMMA3,
         "sliding": vllm_hybrid.MISTRAL}
HOST_TIER = str(4 << 30)
DISK_TIER = str(8 << 30)
TOP = 5


def build(spec) -> Path:
    return (vllm_hybrid.build(spec) if isinstance(spec, vllm_hybrid.SlidingSpec)
            else vllm_models.build(spec))


def prompt(spec, length: int) -> list[int]:
    import random

    rng = random.Random(length)
    return [rng.randrange(1, spec.vocab) for _ in range(length)]


def plan(spec, tokens: list[int], repeats: int) -> list[dict]:
    return [{"name": "miss", "prompt": tokens, "max_tokens": 8, "settle_s": 3.0},
            {"name": "own", "prompt": tokens, "max_tokens": 8, "logprobs": TOP},
            {"name": "own_ttft", "prompt": tokens, "max_tokens": 1, "repeat": repeats},
            {"name": "kvtier", "prompt": tokens, "max_tokens": 8, "logprobs": TOP,
             "reset_prefix_cache": True},
            {"name": "kvtier_ttft", "prompt": tokens, "max_tokens": 1, "repeat": repeats,
             "reset_prefix_cache": True}]


def own_blocks(kind: str, window: int, tokens: int) -> int:
    """The blocks vLLM's cache holds for a request of ``tokens`` after it: every block of
    a full group; a sliding group's from the window of its last token on."""
    blocks = -(-tokens // BS)
    if kind == "full":
        return blocks
    return blocks - max(0, tokens - window + 1) // BS


def group_bytes(target: str, spec, tokens: list[int]) -> list[dict]:
    """Per layout the connector registered for ``spec``: the bytes kvtier holds for
    ``tokens`` and the engine's own cache's, per token."""
    import kvtier

    fingerprint = f"{spec.name}-{spec.digest}"
    whole = len(tokens) // BS * BS
    out = []
    with kvtier.Client(target) as client:
        for info in client.layouts():
            layout = info.spec
            if not layout.name.startswith("vllm-"):
                continue
            with client.read_chunks(TENANT, layout, tokens[:whole],
                                    model_fingerprint=fingerprint) as read:
                stored = sum(len(c) for c in read.chunks.values())
            if not stored:
                continue  # another kind's layout
            window = re.search(r"-swa(\d+)-", layout.name)
            kind = "sliding" if window else "full"
            page = layout.persistent_bytes_per_token * BS  # a block of every layer
            own = own_blocks(kind, int(window.group(1)) if window else 0, len(tokens)) * page
            out.append({"layout": layout.name, "kind": kind,
                        "stored_bytes_per_token": stored / len(tokens),
                        "own_bytes_per_token": own / len(tokens)})
    return out


def bench_kind(key: str, length: int, repeats: int, work: Path, run_engine,
               kvtier_connector) -> dict:
    """``run_engine(plan, work, name)`` and ``kvtier_connector(spec, target)``: bench.vllm's
    (an engine in a child process; the connector's settings)."""
    spec = KINDS[key]
    tokens = prompt(spec, length)
    base = {"model": str(build(spec)), "max_model_len": 8192, "prefix_caching": True}
    with LiveServer(work / f"kind-{key}-data", work, replay=False,
                    env={"KVTIER_HOST_BYTES": HOST_TIER, "KVTIER_DISK_BYTES": DISK_TIER}) as live:
        connector = kvtier_connector(spec, live.target)
        connector["kv_connector_extra_config"]["tenant"] = TENANT
        run = run_engine({**base, "connector": connector, "steps": plan(spec, tokens, repeats)},
                         work, f"kind-{key}")
        groups = group_bytes(live.target, spec, tokens)
    steps = {s["name"]: s for s in run["steps"]}
    failed = [s for s in run["steps"] if "error" in s]
    if failed or run.get("start_error"):
        raise RuntimeError(f"kind {key}: {run.get('start_error') or failed[0]['error']}")
    stored = sum(g["stored_bytes_per_token"] for g in groups)
    own = sum(g["own_bytes_per_token"] for g in groups)
    hit, mine = steps["kvtier"], steps["own"]
    return {"kind": key, "model": spec.name, "prompt_tokens": length,
            "stored_vs_own_cache": stored / own if own else None,
            "stored_bytes_per_token": stored, "own_bytes_per_token": own, "groups": groups,
            "ttft_kvtier_hit_s": statistics.median(steps["kvtier_ttft"]["seconds"]),
            "ttft_prefix_cache_s": statistics.median(steps["own_ttft"]["seconds"]),
            "kvtier_hit_cached_tokens": hit["num_cached_tokens"][-1],
            "identical": (hit["output"], hit["top_logprobs"])
            == (mine["output"], mine["top_logprobs"])}
