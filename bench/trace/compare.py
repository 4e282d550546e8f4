"""What the trace benchmark's figures are measured against: its goals, and the
published policies (libCacheSim) on the same trace.

- ``goals``: the project's policy (``kvtier``, no future knowledge) against Belady's
  fast-tier (hbm + host) hit rate among re-reads at hbm = 5% and 10% of the footprint
  (target: at least 0.9 of it), against LRU at every size measured (never below), and
  re-prefilled blocks with retention and an unbounded disk (below 1% of block reads).
- ``one tier``: kvtier's policies as libCacheSim sees a cache: one tier of equal-size
  blocks (no window blobs, no host tier, disk below as the backing store), prefix reads,
  the hbm hit rate among re-reads. ``bench/trace/libcachesim.py`` (run with a Python that
  has libcachesim) wrote ``bench/trace_libcachesim.json`` for the same read sequence;
  it is read here, so bench.trace never needs libcachesim itself.
"""

from __future__ import annotations

import json
from pathlib import Path

LIBCACHESIM_JSON = Path(__file__).resolve().parents[1] / "trace_libcachesim.json"
GOAL_FRACTIONS = (0.05, 0.1)
ONE_TIER_POLICIES = ("kvtier", "lru", "hint-causal", "belady")
BELADY_SHARE = 0.9
REPREFILL_LIMIT = 0.01


def _rate(results: list[dict], policy: str, fraction: float) -> float | None:
    return next((r["reuse_fast_hit_rate"] for r in results
                 if r["policy"] == policy and r["capacity_fraction"] == fraction), None)


def goals(results: list[dict], retention: dict, disk_fraction: float | None) -> dict:
    """The three goals, from the run's own points (None where not measured)."""
    fractions = sorted({r["capacity_fraction"] for r in results})
    vs_belady = {}
    for fraction in GOAL_FRACTIONS:
        own, best = _rate(results, "kvtier", fraction), _rate(results, "belady", fraction)
        if own is not None and best:
            vs_belady[f"{fraction:g}"] = {"kvtier": own, "belady": best,
                                          "share": round(own / best, 4)}
    vs_lru = {f"{f:g}": {"kvtier": _rate(results, "kvtier", f), "lru": _rate(results, "lru", f)}
              for f in fractions}
    with_ = retention["with"]
    reprefill = with_["reprefill_blocks"] / with_["block_reads"] if with_["block_reads"] else 0.0
    below = [f for f, v in vs_lru.items() if None not in v.values() and v["kvtier"] < v["lru"]]
    return {
        "belady_share": {"target": BELADY_SHARE, "points": vs_belady,
                         "met": bool(vs_belady) and all(v["share"] >= BELADY_SHARE
                                                        for v in vs_belady.values())},
        "never_below_lru": {"points": vs_lru, "below_at": below,
                            "met": not below and all(None not in v.values()
                                                     for v in vs_lru.values())},
        "reprefill_with_retention": {"target": REPREFILL_LIMIT, "rate": round(reprefill, 6),
                                     "disk_unbounded": disk_fraction is None,
                                     "policy": retention["policy"],
                                     "met": disk_fraction is None and reprefill < REPREFILL_LIMIT},
    }


def libcachesim_results(trace_path: str, limit: int | None) -> dict:
    """The committed libCacheSim run, if it was made on this very trace (and limit)."""
    if not LIBCACHESIM_JSON.exists():
        return {"missing": f"{LIBCACHESIM_JSON.name} not found; run bench/trace/libcachesim.py"}
    recorded = json.loads(LIBCACHESIM_JSON.read_text())
    trace = recorded.get("trace", {})
    # the same trace file, wherever it was read from (relative or absolute paths)
    if Path(trace.get("path", "")).name != Path(trace_path).name or trace.get("limit") != limit:
        return {"missing": f"{LIBCACHESIM_JSON.name} was made on {trace.get('path')} "
                           f"(limit {trace.get('limit')}), not this trace"}
    return {k: recorded[k] for k in ("libcachesim", "trace", "method", "policies",
                                     "hit_rate_among_rereads")}


def one_tier_summary(points: list[dict]) -> dict:
    """fraction -> policy -> hbm hit rate among re-reads, of the one-tier points."""
    table: dict[str, dict[str, float]] = {}
    for p in points:
        table.setdefault(f"{p['capacity_fraction']:g}", {})[p["policy"]] = round(
            p["reuse_hit_rate"]["hbm"], 4)
    return table
