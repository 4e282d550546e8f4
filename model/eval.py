"""Evaluate the bundled model on held-out stdlib packages: `python -m model.eval --json`.

Bytes are scored through the quantized inference path (model.infer.prefill, i.e. the
kernels, int8 window KV, int4 compressed KV), at several context lengths (1k, 8k, 32k by
default): the same sampled stretches of held-out bytes are cut into pieces of each context
length, each prefilled from an empty state. Only bytes predicted in every cut are scored,
so the figures compare like with like; gzip -9 of the same bytes is measured in the same
run. The indexer figures run the training forward on shorter held-out sequences.

`--quick` (one stretch, two short sequences for the indexers) bounds a smoke run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from model import checkpoint
from model.config import layout_spec
from model.data import HELD_OUT, corpus
from model.dense import forward_train
from model.infer import prefill
from model.net import KVTierLM

CONTEXTS = (1024, 8192, 32768)
INDEX_SEQS, INDEX_LEN = 4, 2048  # held-out sequences for indexer_mass / random_mass
LEGACY_INDEX_LEN = 512  # the earlier indexer figures' length, kept under their old keys


def context_key(context: int) -> str:
    """The --json key of a context's bits/byte: 1024 -> bits_per_byte_1k."""
    label = f"{context // 1024}k" if context % 1024 == 0 else str(context)
    return f"bits_per_byte_{label}"


def gzip_bits_per_byte(data: bytes) -> float:
    return 8 * len(gzip.compress(data, 9)) / len(data)


def segments(data: bytes, count: int, length: int) -> list[bytes]:
    """`count` stretches of `length` bytes at evenly spaced, fixed offsets."""
    if len(data) < length:
        raise ValueError(f"held-out data ({len(data)} bytes) is shorter than {length}")
    span = len(data) - length
    offsets = [span * i // max(count - 1, 1) for i in range(count)]
    return [data[o:o + length] for o in offsets]


def token_bits(model: KVTierLM, seg: bytes, context: int, chunk: int) -> torch.Tensor:
    """Bits for predicting every byte of `seg` from the bytes before it inside its
    context-sized piece; NaN for bytes that start a piece (nothing to predict them from)."""
    ids = torch.tensor(list(seg), dtype=torch.int64)
    bits = torch.full((ids.numel(),), float("nan"))
    for start in range(0, ids.numel(), context):
        piece = ids[start:start + context]
        _, logits = prefill(model, piece, logits="all", chunk=chunk)
        ce = F.cross_entropy(logits[:-1], piece[1:], reduction="none") / math.log(2)
        bits[start + 1:start + piece.numel()] = ce
    return bits


@torch.no_grad()
def indexer_quality(model: KVTierLM, data: bytes, seqs: int, length: int
                    ) -> tuple[list, float, list]:
    """Per indexer (in layer order), the share of its layers' dense compressed attention
    that its top-k selection holds on held-out text; what a random top-k would hold
    (k / visible entries, averaged over the queries that see more than k); and per
    indexer the most a top-k of its candidates could hold (model.dense.selection_quality)."""
    ids = torch.tensor([list(s) for s in segments(data, seqs, length)], dtype=torch.int64)
    stats: list[dict] = []
    forward_train(model, ids, sparse=True, stats=stats)
    return ([round(s["captured"], 4) for s in stats], round(stats[0]["random"], 4),
            [round(s["best"], 4) for s in stats])


def evaluate(model: KVTierLM, count: int, contexts: tuple[int, ...] = CONTEXTS,
             chunk: int = 512, index_seqs: int = INDEX_SEQS, index_len: int = INDEX_LEN) -> dict:
    """Every figure of `--json`; `count` stretches of max(contexts) held-out bytes."""
    data = corpus(held_out=True)
    segs = segments(data, count, max(contexts))
    start = time.time()
    bits = {c: torch.cat([token_bits(model, s, c, chunk) for s in segs]) for c in contexts}
    scored = ~torch.stack([b.isnan() for b in bits.values()]).any(0)
    sample = b"".join(segs)
    spec = layout_spec(model.cfg)
    mass, random, best = indexer_quality(model, data, index_seqs, index_len)
    legacy_mass, legacy_random, _ = indexer_quality(model, data, index_seqs, LEGACY_INDEX_LEN)
    return {
        "params": model.num_params(),
        **{context_key(c): round(b[scored].mean().item(), 4) for c, b in bits.items()},
        "contexts": list(contexts),
        "gzip_bits_per_byte": round(gzip_bits_per_byte(sample), 4),
        "gzip_bits_per_byte_all_held_out": round(gzip_bits_per_byte(data), 4),
        "bytes_scored": int(scored.sum()),
        "segments": count,
        "segment_bytes": max(contexts),
        "held_out_packages": list(HELD_OUT),
        "held_out_bytes": len(data),
        "persistent_bytes_per_token": spec.persistent_bytes_per_token,
        "bf16_baseline_bytes_per_token": spec.bf16_baseline_bytes_per_token,
        "indexer_mass": mass,
        "random_mass": random,
        "indexer_mass_ratio": [round(m / random, 3) for m in mass],
        # the ceiling: the most a top-k of each indexer's candidates could hold
        "indexer_best_mass": best,
        "indexer_seq_len": index_len,
        "indexer_seqs": index_seqs,
        # the same figures on 512-byte sequences, as reported before
        "indexer_mass_captured": legacy_mass,
        "random_topk_mass": legacy_random,
        "eval_wall_s": round(time.time() - start, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--segments", type=int, default=4,
                        help="held-out stretches of the longest context to score (default 4)")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                        help="context lengths in bytes, comma-separated (default 1k, 8k, 32k)")
    parser.add_argument("--quick", action="store_true",
                        help="one stretch and two indexer sequences: a bounded smoke run")
    parser.add_argument("--weights", type=Path, default=checkpoint.BUNDLED_WEIGHTS)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    contexts = tuple(int(c) for c in args.contexts.split(",") if c)
    if not contexts or any(c <= 1 for c in contexts):
        parser.error("--contexts needs lengths above one byte")
    torch.set_num_threads(args.threads)
    result = evaluate(checkpoint.load(args.weights), 1 if args.quick else args.segments,
                      contexts, index_seqs=2 if args.quick else INDEX_SEQS)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:32s} {value}")


if __name__ == "__main__":
    main()
