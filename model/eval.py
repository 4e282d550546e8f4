"""Evaluate the bundled model on held-out stdlib packages: `python -m model.eval --json`.

Bytes are scored through the quantized inference path (model.infer.prefill, i.e. the
kernels, int8 window KV, int4 compressed KV), at two context lengths: the same sampled
stretches of held-out bytes are cut into 8,192-byte segments (context 8k) and into 1,024-byte
segments (context 1k), each prefilled from an empty state. Only bytes predicted in both
cuts are scored, so the two figures compare like with like; gzip -9 of the same bytes is
measured in the same run.
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

SHORT, LONG = 1024, 8192


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
def indexer_quality(model: KVTierLM, data: bytes, seqs: int = 4, length: int = 512) -> dict:
    """Share of each layer group's dense compressed attention that its indexer's top-k
    selection holds on held-out text, next to what a random top-k would hold."""
    ids = torch.tensor([list(s) for s in segments(data, seqs, length)], dtype=torch.int64)
    stats: list[dict] = []
    forward_train(model, ids, sparse=True, stats=stats)
    return {"indexer_mass_captured": [round(s["captured"], 3) for s in stats],
            "random_topk_mass": round(stats[0]["random"], 3)}


def evaluate(model: KVTierLM, count: int, chunk: int = 512) -> dict:
    data = corpus(held_out=True)
    segs = segments(data, count, LONG)
    start = time.time()
    short = torch.cat([token_bits(model, s, SHORT, chunk) for s in segs])
    long = torch.cat([token_bits(model, s, LONG, chunk) for s in segs])
    scored = ~(short.isnan() | long.isnan())
    sample = b"".join(segs)
    spec = layout_spec(model.cfg)
    return {
        "params": model.num_params(),
        "bits_per_byte_1k": round(short[scored].mean().item(), 4),
        "bits_per_byte_8k": round(long[scored].mean().item(), 4),
        "gzip_bits_per_byte": round(8 * len(gzip.compress(sample, 9)) / len(sample), 4),
        "gzip_bits_per_byte_all_held_out": round(8 * len(gzip.compress(data, 9)) / len(data), 4),
        "bytes_scored": int(scored.sum()),
        "segments": count,
        "held_out_packages": list(HELD_OUT),
        "held_out_bytes": len(data),
        "persistent_bytes_per_token": spec.persistent_bytes_per_token,
        "bf16_baseline_bytes_per_token": spec.bf16_baseline_bytes_per_token,
        **indexer_quality(model, data),
        "eval_wall_s": round(time.time() - start, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--segments", type=int, default=12,
                        help="8,192-byte held-out stretches to score (default 12)")
    parser.add_argument("--weights", type=Path, default=checkpoint.BUNDLED_WEIGHTS)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = evaluate(checkpoint.load(args.weights), args.segments)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:32s} {value}")


if __name__ == "__main__":
    main()
