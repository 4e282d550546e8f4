"""libCacheSim's policies on a request trace and on each generated shape, as one tier of
equal-size blocks.

    python3.11 -m venv /work/helpers/lcs-venv
    /work/helpers/lcs-venv/bin/pip install libcachesim==0.3.5
    /work/helpers/lcs-venv/bin/python -m bench.trace.libcachesim \\
        --trace ../shared/traces/mooncake_synthetic_trace.jsonl

Runs with a Python that has ``libcachesim`` (0.3.5, PyPI) installed, in a scratch virtual
environment outside the repository: the project does not depend on it. It writes
``bench/trace_libcachesim.json`` (one entry per workload: the trace by its file name, each
shape of ``bench.trace.shapes`` by name, scale and seed), which is committed;
``bench.trace`` reads that file to show kvtier next to these policies on the same read
sequence, and never imports libcachesim itself.

The read sequence is the trace's "prefix reads": every request reads each of its complete
512-token blocks (``TraceRequest.full_blocks``), in prompt order, as an engine looking its
prompt up by chunk key would. One cache of ``fraction x unique blocks`` objects of size 1;
a miss inserts the block (libCacheSim's ``get``). Belady gets each read's next-access
position. The figure is the hit rate among re-reads: hits / (reads - first reads), so the
compulsory misses of first reads, the same for every policy, are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.trace.reader import TraceRequest, read_trace
from bench.trace.shapes import SHAPES, generate

OUT = Path(__file__).resolve().parents[1] / "trace_libcachesim.json"
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2)
# label -> libcachesim class name; default parameters throughout
POLICIES = {"LRU": "LRU", "ARC": "ARC", "LHD": "LHD", "3L-Cache": "ThreeLCache",
            "LeCaR": "LeCaR", "Cacheus": "Cacheus", "S3-FIFO": "S3FIFO", "Belady": "Belady"}
NO_NEXT_ACCESS = 2**63 - 1  # INT64_MAX: libCacheSim's "never requested again"


def prefix_reads(requests: Sequence[TraceRequest]) -> list[int]:
    """Every complete block of every request, in trace order (the block ids)."""
    return [b for r in requests for b in r.hash_ids[:r.full_blocks]]


def next_access(reads: Sequence[int]) -> list[int]:
    """Per read, the position of the next read of the same block, or NO_NEXT_ACCESS."""
    out = [NO_NEXT_ACCESS] * len(reads)
    seen: dict[int, int] = {}
    for position in range(len(reads) - 1, -1, -1):
        out[position] = seen.get(reads[position], NO_NEXT_ACCESS)
        seen[reads[position]] = position
    return out


def hit_rate_among_rereads(lcs, policy: str, capacity: int, reads: Sequence[int],
                           nexts: Sequence[int]) -> float:
    cache = getattr(lcs, POLICIES[policy])(capacity)
    request = lcs.Request()
    request.obj_size = 1
    hits = 0
    for position, (block, upcoming) in enumerate(zip(reads, nexts, strict=True)):
        request.obj_id = block
        request.clock_time = position
        request.next_access_vtime = upcoming
        hits += cache.get(request)
    rereads = len(reads) - len(set(reads))
    return hits / rereads if rereads else 0.0


def run_one(lcs, source: str, requests: Sequence[TraceRequest], limit: int | None,
            fractions: Sequence[float]) -> dict:
    started = time.perf_counter()
    reads = prefix_reads(requests)
    nexts = next_access(reads)
    unique = len(set(reads))
    results = {}
    for fraction in fractions:
        capacity = max(1, int(fraction * unique))
        results[f"{fraction:g}"] = {
            policy: round(hit_rate_among_rereads(lcs, policy, capacity, reads, nexts), 4)
            for policy in POLICIES}
    return {"source": source, "limit": limit, "block_reads": len(reads),
            "unique_blocks": unique, "rereads": len(reads) - unique,
            "policies": list(POLICIES), "hit_rate_among_rereads": results,
            "elapsed_s": round(time.perf_counter() - started, 1)}


def run(trace: str | Path | None, *, limit: int | None = None,
        shapes: Sequence[str] = tuple(SHAPES), shape_scale: float = 1.0, seed: int = 0,
        fractions: Sequence[float] = FRACTIONS) -> dict:
    """One entry per workload; a shape is named as ``bench.trace.run`` looks it up
    (``shape:NAME@SCALE/SEED``)."""
    import libcachesim as lcs

    workloads = []
    if trace is not None:
        workloads.append(run_one(lcs, Path(trace).name, read_trace(trace, limit), limit,
                                 fractions))
    for name in shapes:
        workloads.append(run_one(lcs, f"shape:{name}@{shape_scale:g}/{seed}",
                                 generate(name, scale=shape_scale, seed=seed), None, fractions))
    return {
        "benchmark": "trace_libcachesim",
        "libcachesim": getattr(lcs, "__version__", "unknown"),
        "method": "one tier of equal-size blocks (size 1), capacity = fraction x unique "
                  "blocks; reads: every complete block of every request in order (prefix "
                  "reads); a miss inserts; hit rate among re-reads = hits / (reads - first "
                  "reads); libCacheSim default parameters; Belady given each read's next "
                  "access position",
        "workloads": workloads,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trace.libcachesim",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--trace")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--shape-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    report = run(args.trace, limit=args.limit, shapes=[n for n in args.shapes.split(",") if n],
                 shape_scale=args.shape_scale, seed=args.seed)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for workload in report["workloads"]:
        for fraction, rates in workload["hit_rate_among_rereads"].items():
            print(workload["source"], fraction,
                  " ".join(f"{p} {v:.3f}" for p, v in rates.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
