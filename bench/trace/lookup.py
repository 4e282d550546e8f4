"""What a Lookup costs next to the prefill it saves: the bundled model, one run.

    python -m bench.trace.lookup --tokens 65536 --json

The model (``bench.resume.load_model``: the bundled weights, or its config with seeded
random weights when the file is missing) prefills ``tokens`` tokens of held-out text,
timed once after a warm-up; the state is spilled (``replay.state_codec``, the client's
encoding) into a ``TierManager`` over a host tier; then ``TierManager.lookup`` of the
same token ids is timed ``repeats`` times (the median counts; the gRPC Lookup is this
call plus one round trip). The lookup computes every chunk's chain key from the token
ids and walks the chain index: the figure includes the hashing of all ``tokens``.
``bench.trace`` runs this as part of its run (``--lookup-tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import torch

from bench.resume import TENANT, held_out_ids, load_model, spec_for
from kvstore.format.keys import dedupe_scope
from kvstore.session.manager import TierManager
from kvstore.tiers.base import MemoryMetaStore
from kvstore.tiers.host import HostTier
from model import checkpoint
from model.infer import prefill
from replay.state_codec import state_to_chunks

GOAL_RATIO = 0.01  # lookup below 1% of the prefill it saves


async def _lookup_times(spec, state, repeats: int) -> tuple[list[float], int]:
    chunks, tail, window = state_to_chunks(spec, state, scope=dedupe_scope(TENANT))
    size = sum(len(data) for _, data in chunks) + len(tail) + len(window or b"")
    manager = await TierManager.open([HostTier(2 * size + (1 << 20), pin_memory=False)],
                                     MemoryMetaStore())
    async with manager:
        tokens = state.token_ids.numpy()
        await manager.spill(TENANT, "prefix", layout_id=spec.layout_id, generation=1,
                            token_ids=tokens, chunks=chunks, tail=tail, window=window)
        times, held = [], 0
        for _ in range(repeats):
            started = time.perf_counter()
            held = manager.lookup(TENANT, spec.layout_id, tokens).tokens_held
            times.append(time.perf_counter() - started)
    return times, held


def measure(tokens: int = 65536, repeats: int = 20,
            weights=checkpoint.BUNDLED_WEIGHTS, threads: int = 1) -> dict:
    """Prefill ``tokens`` tokens, spill, time ``lookup`` of them; see the module doc.
    ``threads``: torch intra-op threads (1, as bench.resume: OpenMP threads spinning on
    a shared machine make prefill several times slower)."""
    torch.set_num_threads(threads)
    model, info = load_model(weights)
    spec = spec_for(model.cfg)
    ids = held_out_ids(tokens, offset=0.25)
    prefill(model, ids[:min(512, tokens)], logits="none")  # first-call costs
    started = time.perf_counter()
    with torch.inference_mode():
        state, _ = prefill(model, ids, logits="none")
    prefill_s = time.perf_counter() - started
    times, held = asyncio.run(_lookup_times(spec, state, repeats))
    lookup_s = statistics.median(times)
    ratio = lookup_s / prefill_s
    return {
        "tokens": tokens,
        "chunk_tokens": spec.chunk_tokens,
        "tokens_held": held,
        "prefill_s": round(prefill_s, 4),
        "lookup_s": lookup_s,
        "lookup_s_min_max": [min(times), max(times)],
        "repeats": repeats,
        "lookup_vs_prefill": ratio,
        "goal_ratio": GOAL_RATIO,
        "met": ratio < GOAL_RATIO and held == tokens // spec.chunk_tokens * spec.chunk_tokens,
        "model": info,
        "torch_threads": torch.get_num_threads(),
        "method": "one process: bundled model prefill of held-out text (timed once, after "
                  "a warm-up), spill into a TierManager over a host tier, then "
                  "TierManager.lookup of the same token ids (chain keys of every chunk "
                  "from the token ids, then the chain index), median of the repeats",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trace.lookup",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.tokens, args.repeats)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['tokens']} tokens: prefill {result['prefill_s']:.2f} s, lookup "
              f"{result['lookup_s'] * 1000:.2f} ms ({result['lookup_vs_prefill']:.2e} of "
              f"prefill; goal < {GOAL_RATIO:g}: {'met' if result['met'] else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
