"""What the trace benchmark's figures are measured against: its goals, Belady's bound,
and the published policies (libCacheSim) on the same requests.

Per workload (the trace, and each generated shape), on the two-tier stack (hbm + host
over disk) and the headline figure ``reuse_fast_value`` (fast hits among re-reads, a
window's resume weighed as ``replay_cost`` chunk reads, see ``bench.trace.run``):

- ``monotone``: kvtier's figure never falls as the hbm fraction grows;
- ``never_below_lru``: kvtier's at least LRU's at every fraction;
- ``belady_share``: kvtier / Belady at every fraction, target ``BELADY_SHARE``; a share
  above 1 is refused (not met, flagged): Belady is the bound;
- ``one_tier_vs_best_classical``: on one tier of equal-size blocks (no windows, no host),
  kvtier's hit rate among re-reads against the best of libCacheSim's policies
  (``bench/trace/libcachesim.py`` wrote them to ``bench/trace_libcachesim.json``; read
  here, so bench.trace never needs libcachesim);
- ``belady_bound``: every policy at most Belady at every point, on the headline figure,
  the blocks' fast hit rate and the one-tier hit rate; a policy above Belady is a bug of
  the simulation or of Belady, and is listed.

"Belady" at a point is the best of the offline references run there (``BOUNDS``):
``belady`` weighs each block's distance by size over cost (a window's loss is a replay),
the bound of the headline figure; ``belady-blocks`` weighs every block alike, the bound
of the blocks' own hit rate, which a policy dropping windows to keep chunks can raise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

LIBCACHESIM_JSON = Path(__file__).resolve().parents[1] / "trace_libcachesim.json"
ONE_TIER_POLICIES = ("kvtier", "lru", "belady")
CLASSICAL = ("LRU", "ARC", "LHD", "3L-Cache", "LeCaR", "Cacheus", "S3-FIFO")
BELADY_SHARE = 0.95
REPREFILL_LIMIT = 0.01
HEADLINE = "reuse_fast_value"
EPS = 1e-9  # float noise in comparing two rates
BOUNDS = ("belady", "belady-blocks")  # the offline references; "Belady" is their best


def rates_by_policy(results: Sequence[dict], metric: str) -> dict[str, dict[float, float]]:
    """policy -> fraction -> ``metric`` of the points ("hbm": the hbm hit rate among
    re-reads, the one-tier figure); "belady": the best of ``BOUNDS`` at each fraction."""
    out: dict[str, dict[float, float]] = {}
    for r in results:
        value = r["reuse_hit_rate"]["hbm"] if metric == "hbm" else r[metric]
        name = "belady" if r["policy"] in BOUNDS else r["policy"]
        by_fraction = out.setdefault(name, {})
        f = r["capacity_fraction"]
        by_fraction[f] = max(value, by_fraction.get(f, value))
    return out


def monotone(results: Sequence[dict], policy: str = "kvtier") -> dict:
    """Whether ``policy``'s headline figure never falls as the fraction grows (and where
    it does: the pairs of fractions), for every policy run (kvtier's decides ``met``)."""
    by_policy = {}
    for name, points in rates_by_policy(results, HEADLINE).items():
        fractions = sorted(points)
        drops = [[f"{a:g}", f"{b:g}", round(points[a], 4), round(points[b], 4)]
                 for a, b in zip(fractions, fractions[1:], strict=False)
                 if points[b] < points[a] - EPS]
        by_policy[name] = {"met": not drops, "drops": drops}
    return {"policy": policy, "met": by_policy.get(policy, {}).get("met"),
            "by_policy": by_policy}


def never_below_lru(results: Sequence[dict]) -> dict:
    rates = rates_by_policy(results, HEADLINE)
    own, lru = rates.get("kvtier", {}), rates.get("lru", {})
    points = {f"{f:g}": {"kvtier": own[f], "lru": lru[f]} for f in sorted(own) if f in lru}
    below = [f for f, v in points.items() if v["kvtier"] < v["lru"] - EPS]
    return {"points": points, "below_at": below, "met": bool(points) and not below}


def belady_share(results: Sequence[dict]) -> dict:
    rates = rates_by_policy(results, HEADLINE)
    own, best = rates.get("kvtier", {}), rates.get("belady", {})
    points = {}
    for f in sorted(own):
        if best.get(f):
            points[f"{f:g}"] = {"kvtier": own[f], "belady": best[f],
                                "share": round(own[f] / best[f], 4)}
    above = [f for f, v in points.items() if v["share"] > 1 + EPS]
    return {"target": BELADY_SHARE, "points": points, "above_one_at": above,
            "met": bool(points) and not above
            and all(v["share"] >= BELADY_SHARE for v in points.values())}


def belady_bound(results: Sequence[dict], one_tier: Sequence[dict]) -> dict:
    """Every point where a policy beats Belady (none: the bound holds)."""
    violations = []
    for label, points, metric in (("two-tier value", results, HEADLINE),
                                  ("two-tier blocks", results, "reuse_fast_hit_rate"),
                                  ("one tier", one_tier, "hbm")):
        rates = rates_by_policy(points, metric)
        bound = rates.get("belady", {})
        for policy, by_fraction in rates.items():
            for f, v in by_fraction.items():
                if f in bound and v > bound[f] + EPS:
                    violations.append({"view": label, "policy": policy, "fraction": f,
                                       "policy_rate": v, "belady": bound[f]})
    return {"held": not violations, "met": not violations, "violations": violations,
            "checked": bool(results) and any(r["policy"] == "belady" for r in results)}


def one_tier_vs_best_classical(ours: dict[str, dict[str, float]], libcachesim: dict) -> dict:
    """kvtier's one-tier hit rate among re-reads against the best classical policy's at
    each fraction libCacheSim was run at."""
    theirs = libcachesim.get("hit_rate_among_rereads")
    if not theirs:
        return {"met": None, "missing": libcachesim.get("missing", "no libCacheSim run")}
    points = {}
    for f, rates in ours.items():
        classical = {p: v for p, v in theirs.get(f, {}).items() if p in CLASSICAL}
        if "kvtier" not in rates or not classical:
            continue
        best = max(classical, key=classical.__getitem__)
        points[f] = {"kvtier": rates["kvtier"], "best": best, "best_rate": classical[best],
                     "margin": round(rates["kvtier"] - classical[best], 4)}
    return {"points": points, "met": bool(points) and all(
        v["margin"] >= -EPS for v in points.values())}


def goals(results: Sequence[dict], one_tier_points: Sequence[dict], one_tier: dict,
          libcachesim: dict, retention: dict | None, disk_fraction: float | None) -> dict:
    """The goals of one workload, from its own points."""
    out = {
        "monotone": monotone(results),
        "never_below_lru": never_below_lru(results),
        "belady_share": belady_share(results),
        "one_tier_vs_best_classical": one_tier_vs_best_classical(one_tier, libcachesim),
        "belady_bound": belady_bound(results, one_tier_points),
    }
    if retention is not None:
        with_ = retention["with"]
        rate = with_["reprefill_blocks"] / with_["block_reads"] if with_["block_reads"] else 0.0
        out["reprefill_with_retention"] = {
            "target": REPREFILL_LIMIT, "rate": round(rate, 6),
            "disk_unbounded": disk_fraction is None, "policy": retention["policy"],
            "met": disk_fraction is None and rate < REPREFILL_LIMIT}
    return out


def libcachesim_results(source: str, limit: int | None) -> dict:
    """The committed libCacheSim run of this workload (a trace file's name, or a shape's
    name and parameters), if there is one."""
    if not LIBCACHESIM_JSON.exists():
        return {"missing": f"{LIBCACHESIM_JSON.name} not found; run bench/trace/libcachesim.py"}
    recorded = json.loads(LIBCACHESIM_JSON.read_text())
    for run in recorded.get("workloads", []):
        if run.get("source") == source and run.get("limit") == limit:
            return {"libcachesim": recorded.get("libcachesim"), "method": recorded.get("method"),
                    **{k: run[k] for k in ("source", "limit", "policies",
                                           "hit_rate_among_rereads")}}
    return {"missing": f"{LIBCACHESIM_JSON.name} has no run of {source} (limit {limit})"}


def one_tier_summary(points: Sequence[dict]) -> dict:
    """fraction -> policy -> hbm hit rate among re-reads, of the one-tier points."""
    table: dict[str, dict[str, float]] = {}
    for p in points:
        table.setdefault(f"{p['capacity_fraction']:g}", {})[p["policy"]] = round(
            p["reuse_hit_rate"]["hbm"], 4)
    return table
