"""Block hit rates of kvtier's tier hierarchy on a request trace, per eviction policy.

    python -m bench.trace --json --trace ../shared/traces/mooncake_synthetic_trace.jsonl

It runs the trace, then each generated shape of ``bench.trace.shapes`` (``--shapes``,
``--shape-scale``), and puts every workload's goals (``bench.trace.compare``: the keys
``monotone``, ``never_below_lru``, ``belady_share``, ``one_tier_vs_best_classical``,
``belady_bound``) and table under ``by_shape``.

How each figure is obtained (the JSON repeats this under "method"):

- Trace: Mooncake format, one request per line (``bench.trace.reader``; a bad line is
  rejected with its line number). Each ``hash_ids`` entry is one 512-token prefix block.
- Block bytes: the layout spec's persistent bytes/token x 512 (``--layout``, default
  kvtier-bundled). Window bytes: the spec's ephemeral bytes/token x W = 128 tokens. Both
  are computed from the spec at run time and printed under "layout". A layout without
  ephemeral streams has no window blobs and never needs replay.
- Blocks: a request's complete blocks (input_length // 512 of its hash_ids) are its
  chunks; the partial last block is the session's tail, which kvtier keeps in the
  manifest rather than in a tier, so it is left out (counted as trace.tail_blocks).
- Sessions (``bench.trace.workload``): a request continues an earlier request's session
  only when that request's complete blocks are a prefix of its own and it is still its
  session's latest (the session's head; restore, then spill the next generation); any
  other request starts a new session from what ``Lookup`` finds held (the chunks named by
  key, then read), exactly as the product serves it. A session is deleted
  ``--session-ttl`` seconds after its last request; its chunks are then retained as
  evictable cache (``retain_unreferenced``, the default here) or freed; the
  ``retention`` section compares both. A retained chunk leaving a tier moves down like
  any other unless the full tier below does not admit it (``EvictionPolicy.admits``).
- Tiers: hbm = f x footprint, host = host_ratio x f x footprint, disk unbounded (or
  ``--disk-fraction`` x footprint), footprint = unique blocks x block bytes, for each
  f in ``--fractions``. Windows live only in hbm and host.
- Replay (``bench.trace.sim``): each request reads its blocks (its session's stored
  chunks, or the looked-up prefix; a hit in the highest tier holding it, promotion to hbm
  if lower), prefills the rest (new if never stored, re-prefill otherwise), reads its
  session's window (missing: one bounded replay of W tokens), then spills its blocks and
  new window with its hint; write-back copies every block to disk. Placement mirrors
  ``kvstore.placement.stack.TierStack``. Time is a virtual clock at the trace's timestamps.
- Policies: ``kvtier`` (the project's own: ``kvstore.eviction.reuse.ReusePolicy``, one
  model per tier stack, hit density per reuse class learned online from reads, resume
  hints inferred from the past only, as the TierManager infers them: no future
  knowledge), ``kvtier-hint`` (the same given the oracle-derived hints of ``hint``),
  ``kvtier-returns`` (a probe, not run by default: the same told only whether each
  session comes back, not when),
  ``lru`` (LRUPolicy), ``hint`` (HintPolicy given the true gap to the
  session's next request x lognormal noise, sigma ``--hint-sigma``: an oracle-derived
  estimate, labelled as such), ``hint-perfect`` (sigma 0), ``hint-causal`` (HintPolicy
  given the hints kvtier infers itself from the past only, ``kvstore.eviction.pause_estimate``: a
  session's first request a long pause, a later one a pause of 0: recency), ``belady``
  (evict the block whose next read is farthest ahead, from a next-use table of the whole
  trace, retained chunks ranked with the rest, bypass when moving down;
  ``bench.trace.belady``): the bound every other policy is checked against.
- Headline figure (``reuse_fast_value``): hbm + host hits among re-reads, each resume's
  window weighed as ``--replay-cost`` chunk reads (what its replay costs), so a policy
  cannot look good by dropping windows; kvtier's policy weighs windows the same way.
- ``--validate N`` replays the first N requests (default 300) with session TTL
  ``--validate-ttl`` (default 20 s) through the real ``TierStack`` (``bench.trace.check``)
  and the real ``TierManager`` (``bench.trace.manager_check``) over real HBM, host and disk
  tiers and reports whether their counts equal the simulation's, and what the prefix
  covered (``covers``: sessions ended, retained chunks read again, disk reads, misses).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.paths import recorded
from bench.trace import shapes
from bench.trace.compare import (
    HEADLINE,
    ONE_TIER_POLICIES,
    goals,
    libcachesim_results,
    one_tier_summary,
    rates_by_policy,
)
from bench.trace.method import describe_method
from bench.trace.policies import POLICIES, setup_policy
from bench.trace.reader import BLOCK_TOKENS, TraceRequest, read_trace
from bench.trace.sim import SimTier, TierSim, replay
from bench.trace.summary import summarize
from bench.trace.text import GOAL_KEYS, format_table
from bench.trace.workload import DEFAULT_SESSION_TTL_S, Workload, build_workload
from kvstore.eviction.reuse import REPLAY_COST_READS
from kvstore.format.errors import InvalidRequest, KVTierError
from kvstore.format.registry import get_layout

DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2)
DEFAULT_POLICIES = ("kvtier", "lru", "hint", "hint-causal", "kvtier-hint", "belady",
                    "belady-blocks")
# the generated shapes: the goals' policies
SHAPE_POLICIES = ("kvtier", "lru", "belady", "belady-blocks")
WINDOW_TOKENS = 128  # W: the window kept exactly, and the bounded replay's length R
TIER_NAMES = ("hbm", "host", "disk")
SHAPE_PREFIX = "shape:"  # a source naming a generated shape instead of a trace file
# the validation's own session TTL: short enough that its prefix sees sessions end,
# retained chunks looked up again, disk reads and replays (it states what it saw)
DEFAULT_VALIDATE_REQUESTS = 300
DEFAULT_VALIDATE_TTL_S = 20.0
VALIDATE_FRACTION = 0.02  # small enough that LRU loses windows there (misses)


def load_requests(source: str | Path, limit: int | None = None, *, shape_scale: float = 1.0,
                  seed: int = 0) -> list[TraceRequest]:
    """A trace file's requests, or a generated shape's (``shape:NAME``)."""
    text = str(source)
    if text.startswith(SHAPE_PREFIX):
        requests = shapes.generate(text[len(SHAPE_PREFIX):], scale=shape_scale, seed=seed)
        return requests[:limit] if limit is not None else requests
    return read_trace(source, limit)


def layout_sizes(layout: str, window_tokens: int = WINDOW_TOKENS) -> dict:
    spec = get_layout(layout)
    return {
        "name": spec.name,
        "layout_id": spec.layout_id,
        "block_tokens": BLOCK_TOKENS,
        "persistent_bytes_per_token": spec.persistent_bytes_per_token,
        "block_bytes": math.ceil(spec.persistent_bytes_per_token * BLOCK_TOKENS),
        "ephemeral_bytes_per_token": spec.ephemeral_bytes_per_token,
        "window_tokens": window_tokens,
        "window_bytes": math.ceil(spec.ephemeral_bytes_per_token * window_tokens),
    }


def make_tiers(footprint: int, fraction: float, host_ratio: float,
               disk_fraction: float | None) -> list[SimTier]:
    return [
        SimTier("hbm", int(fraction * footprint), holds_window=True, durable=False),
        SimTier("host", int(host_ratio * fraction * footprint), holds_window=True, durable=False),
        SimTier("disk", math.inf if disk_fraction is None else int(disk_fraction * footprint),
                holds_window=False, durable=True),
    ]


def simulate(workload: Workload, policy: str, tiers: Sequence[SimTier], block_bytes: int,
             window_bytes: int, *, hint_sigma: float = 0.5, seed: int = 0,
             retained_first: bool = True, replay_cost: float = REPLAY_COST_READS) -> TierSim:
    """Replay ``workload`` through a fresh ``TierSim`` driven by ``policy``; return it."""
    setup = setup_policy(workload, policy, hint_sigma=hint_sigma, seed=seed,
                         replay_cost=replay_cost)
    sim = TierSim(tiers, setup.factory, block_bytes, window_bytes, retain=workload.retain,
                  retained_first=retained_first)
    replay(workload, sim, setup.hints, setup.clock.set, setup.advance)
    return sim


_WORKLOADS: dict[tuple[bool, bool], Workload] = {}


def _init_worker(source: str, limit: int | None, windows: bool, ttl_s: float | None,
                 shape_scale: float, seed: int) -> None:
    requests = load_requests(source, limit, shape_scale=shape_scale, seed=seed)
    for retain, with_windows in ((True, windows), (False, windows), (True, False)):
        _WORKLOADS[retain, with_windows] = build_workload(
            requests, windows=with_windows, retain=retain, session_ttl_s=ttl_s)


def _run_point(job: dict) -> dict:
    start = time.perf_counter()
    if job["one_tier"]:  # as libCacheSim's cache: equal-size blocks in one tier over disk
        tiers = make_tiers(job["footprint"], job["fraction"], 0.0, None)
        workload = _WORKLOADS[True, False]
    else:
        tiers = make_tiers(job["footprint"], job["fraction"], job["host_ratio"],
                           job["disk_fraction"])
        workload = _WORKLOADS[job["retain"], job["window_bytes"] > 0]
    sim = simulate(workload, job["policy"], tiers, job["block_bytes"],
                   0 if job["one_tier"] else job["window_bytes"],
                   hint_sigma=job["hint_sigma"], seed=job["seed"],
                   retained_first=job["retained_first"], replay_cost=job["replay_cost"])
    return {"policy": job["policy"], "capacity_fraction": job["fraction"],
            "retain": job["retain"], "one_tier": job["one_tier"],
            **summarize(sim, job["window_tokens"], job["replay_cost"]),
            "sim_seconds": round(time.perf_counter() - start, 2)}


def _validate(requests: Sequence[TraceRequest], policies: Sequence[str], host_ratio: float,
              hint_sigma: float, seed: int, session_ttl_s: float | None) -> dict:
    from bench.trace.check import check_against_stack  # imports torch and the tiers
    from bench.trace.manager_check import check_against_manager

    options = {"policies": policies, "host_ratio": host_ratio, "hint_sigma": hint_sigma,
               "seed": seed, "session_ttl_s": session_ttl_s}
    stack = check_against_stack(requests, fractions=(VALIDATE_FRACTION,), **options)
    manager = check_against_manager(requests, fraction=VALIDATE_FRACTION, **options)
    seen = stack["covered"]
    return {"agree": stack["agree"] and manager["agree"], "requests": len(requests),
            "hbm_fraction": VALIDATE_FRACTION, "session_ttl_s": session_ttl_s,
            "span_s": stack["span_s"],
            "covers": seen, "covers_all": all(v > 0 for v in seen.values()),
            "tier_stack": stack, "manager": manager}


def _points(policies: Sequence[str], fractions: Sequence[float], one_tier: bool,
            common: dict) -> list[dict]:
    points = [{"policy": p, "fraction": f, "retain": True, "one_tier": False, **common}
              for f in fractions for p in policies]
    if one_tier:
        points += [{"policy": p, "fraction": f, "retain": True, "one_tier": True, **common}
                   for f in fractions for p in ONE_TIER_POLICIES if p in policies]
    middle = sorted(fractions)[len(fractions) // 2]
    points.append({"policy": policies[0], "fraction": middle, "retain": False,
                   "one_tier": False, **common})
    return points


def run_trace_benchmark(
    trace: str | Path,
    *,
    limit: int | None = None,
    layout: str = "kvtier-bundled",
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    host_ratio: float = 4.0,
    disk_fraction: float | None = None,
    policies: Sequence[str] = DEFAULT_POLICIES,
    hint_sigma: float = 0.5,
    seed: int = 0,
    window_tokens: int = WINDOW_TOKENS,
    validate_requests: int = 0,
    validate_ttl_s: float | None = DEFAULT_VALIDATE_TTL_S,
    jobs: int = 2,
    session_ttl_s: float | None = DEFAULT_SESSION_TTL_S,
    one_tier_comparison: bool = True,
    lookup_tokens: int = 0,
    retained_first: bool = True,
    replay_cost: float = REPLAY_COST_READS,
    shape_scale: float = 1.0,
) -> dict:
    """Every (policy, capacity fraction) point of one workload (a trace file, or
    ``shape:NAME``, a ``bench.trace.shapes`` workload at ``shape_scale``, seeded by
    ``seed``); see the module docstring for the method.

    ``result["results"]``: one dict per point (with retention) with ``policy``,
    ``capacity_fraction``, ``block_hit_rate`` (per tier, ``new``, ``reprefill``),
    ``fast_hit_rate``, ``reuse_fast_value`` (the headline), replays, bytes moved;
    ``bench.report_plots`` plots ``fast_hit_rate`` against the fraction.
    ``result["retention"]``: the first policy's re-prefills at the middle fraction with
    and without retention. ``result["goals"]``: ``bench.trace.compare.goals``.
    """
    started = time.perf_counter()
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise InvalidRequest(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if not fractions or any(not f > 0 for f in fractions):
        raise InvalidRequest(f"capacity fractions must be > 0, got {list(fractions)}")
    if host_ratio < 0 or (disk_fraction is not None and not disk_fraction > 0) or jobs < 1:
        raise InvalidRequest(f"need host_ratio >= 0 (got {host_ratio}), disk_fraction > 0 "
                             f"or None (got {disk_fraction}), jobs >= 1 (got {jobs})")
    if validate_requests and not retained_first:
        raise InvalidRequest("the validation replays the product, which evicts retained chunks "
                             "first; the what-if of a policy ranking them needs validate 0")
    if lookup_tokens < 0 or replay_cost < 0:
        raise InvalidRequest(f"lookup_tokens and replay_cost must be >= 0, got "
                             f"{lookup_tokens} and {replay_cost}")
    for ttl in (session_ttl_s, validate_ttl_s):
        if ttl is not None and not ttl > 0:
            raise InvalidRequest(f"session TTLs must be > 0 or None, got {ttl}")
    sizes = layout_sizes(layout, window_tokens)
    windows = sizes["window_bytes"] > 0
    requests: list[TraceRequest] = load_requests(trace, limit, shape_scale=shape_scale,
                                                 seed=seed)
    workload = build_workload(requests, windows=windows, session_ttl_s=session_ttl_s)
    if not workload.unique_blocks:
        raise InvalidRequest(f"trace {trace} holds no complete {BLOCK_TOKENS}-token block: "
                             "nothing to cache")
    if validate_requests and not any(r.full_blocks for r in requests[:validate_requests]):
        raise InvalidRequest(f"the first {validate_requests} requests hold no complete block "
                             "to validate with; ask for more")
    footprint = workload.unique_blocks * sizes["block_bytes"]
    common = {"footprint": footprint, "host_ratio": host_ratio, "disk_fraction": disk_fraction,
              "block_bytes": sizes["block_bytes"], "window_bytes": sizes["window_bytes"],
              "hint_sigma": hint_sigma, "seed": seed, "window_tokens": window_tokens,
              "retained_first": retained_first, "replay_cost": replay_cost}
    middle = sorted(fractions)[len(fractions) // 2]
    points = _points(policies, fractions, one_tier_comparison, common)
    init = (str(trace), limit, windows, session_ttl_s, shape_scale, seed)
    validation = None
    validate_with = (requests[:validate_requests], policies, host_ratio, hint_sigma, seed,
                     validate_ttl_s)
    if jobs > 1:
        # spawn, not fork: a caller with gRPC threads running (bench.all) deadlocks a
        # forked worker on a lock a thread held at the fork
        with ProcessPoolExecutor(min(jobs, len(points)), initializer=_init_worker,
                                 initargs=init,
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_run_point, point) for point in points]
            if validate_requests:  # meanwhile, in this otherwise idle process
                validation = _validate(*validate_with)
            results = [future.result() for future in futures]
    else:
        _init_worker(*init)
        results = [_run_point(point) for point in points]
        if validate_requests:
            validation = _validate(*validate_with)
    without = results.pop()
    one_tier_points = [r for r in results if r["one_tier"]]
    results = [r for r in results if not r["one_tier"]]
    with_ = next(r for r in results if r["policy"] == policies[0]
                 and r["capacity_fraction"] == middle)
    source = str(trace)
    report = {
        "benchmark": "trace",
        "trace": {"path": source if source.startswith(SHAPE_PREFIX) else recorded(trace),
                  "limit": limit, "requests": len(requests),
                  "block_reads": workload.block_reads, "unique_blocks": workload.unique_blocks,
                  "tail_blocks": workload.tail_blocks, "sessions": workload.sessions,
                  "continuations": workload.continuations,
                  "lookup_starts": workload.lookup_starts, "span_s": workload.span_s,
                  "session_ttl_s": session_ttl_s},
        "layout": sizes,
        "footprint_bytes": footprint,
        "tiers": {"names": list(TIER_NAMES), "host_ratio": host_ratio,
                  "disk_fraction": disk_fraction},
        "retained_first": retained_first,
        "replay_cost": replay_cost,
        "policies": list(policies),
        "method": describe_method(sizes, host_ratio, disk_fraction, hint_sigma, session_ttl_s,
                                  replay_cost),
        "results": results,
        "retention": {"policy": policies[0], "capacity_fraction": middle,
                      **{label: {k: r[k] for k in _RETENTION_KEYS}
                         for label, r in (("with", with_), ("without", without))}},
    }
    if source.startswith(SHAPE_PREFIX):
        name = source[len(SHAPE_PREFIX):]
        report["shape"] = {"name": name, "scale": shape_scale, "seed": seed,
                           "parameters": shapes.parameters(name, shape_scale)}
    lcs_key = _libcachesim_key(source, shape_scale, seed)
    lcs = libcachesim_results(lcs_key, limit) if one_tier_comparison else {}
    one_tier = one_tier_summary(one_tier_points)
    report["goals"] = goals(results, one_tier_points, one_tier, lcs, report["retention"],
                            disk_fraction)
    if lookup_tokens:  # after the simulations, so its timing has the cores to itself
        from bench.trace.lookup import measure  # imports torch and the model

        report["lookup"] = measure(lookup_tokens)
    if one_tier_comparison:
        report["one_tier"] = {
            "method": "kvtier's simulation as one tier of equal-size blocks (no window "
                      "blobs, no host tier; the unbounded disk below is the backing store): "
                      "hbm hit rate among re-reads, on the same re-reads as libCacheSim's",
            "hit_rate_among_rereads": one_tier, "libcachesim": lcs}
    if validation is not None:
        report["validation"] = validation
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    report["machine"] = {"cpus": os.cpu_count(), "jobs": jobs}
    return report


def _libcachesim_key(source: str, shape_scale: float, seed: int) -> str:
    """How ``bench/trace_libcachesim.json`` names a workload: a trace by its file name, a
    shape by its name, scale and seed."""
    if source.startswith(SHAPE_PREFIX):
        return f"{source}@{shape_scale:g}/{seed}"
    return Path(source).name


def run_benchmark(trace: str | Path | None, *, shape_names: Sequence[str] = tuple(shapes.SHAPES),
                  shape_policies: Sequence[str] = SHAPE_POLICIES, **options) -> dict:
    """The trace (if any, with every option) and then each generated shape (its policies,
    no validation or lookup timing): the trace's report, with ``shapes`` (each shape's
    report) and ``by_shape`` (every workload's goals and table)."""
    if trace is None and not shape_names:
        raise InvalidRequest("nothing to run: give a trace or at least one shape")
    for name in shape_names:
        shapes.parameters(name)  # refuses an unknown shape before anything runs
    started = time.perf_counter()
    report = run_trace_benchmark(trace, **options) if trace is not None else {}
    shape_options = {**options, "policies": shape_policies, "validate_requests": 0,
                     "lookup_tokens": 0, "limit": None}
    report["shapes"] = {name: run_trace_benchmark(f"{SHAPE_PREFIX}{name}", **shape_options)
                        for name in shape_names}
    workloads = ({Path(trace).stem: report} if trace is not None else {}) | report["shapes"]
    report["by_shape"] = {name: {**{k: r["goals"][k] for k in GOAL_KEYS},
                                 "table": shape_table(r)} for name, r in workloads.items()}
    report["all_shapes_met"] = {k: _all_met([v[k]["met"] for v in report["by_shape"].values()])
                                for k in GOAL_KEYS}
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    return report


def _all_met(met: Sequence[bool | None]) -> bool | None:
    """False if any workload missed the goal, None if any was not measured, else True."""
    return False if False in met else None if None in met else True



def shape_table(report: dict) -> list[dict]:
    """Per fraction: Belady, LRU and kvtier on the two-tier stack (headline figure), and
    on one tier Belady, LRU, ARC (libCacheSim), the best classical policy and kvtier."""
    two: dict[float, dict[str, float]] = {}
    for policy, points in rates_by_policy(report["results"], HEADLINE).items():
        for f, value in points.items():
            two.setdefault(f, {})[policy] = round(value, 4)
    one = report.get("one_tier", {})
    ours, lcs = one.get("hit_rate_among_rereads", {}), one.get("libcachesim", {})
    theirs = lcs.get("hit_rate_among_rereads", {})
    best = report["goals"]["one_tier_vs_best_classical"].get("points", {})
    rows = []
    for f in sorted(two):
        key = f"{f:g}"
        rows.append({"fraction": f, **{f"two_tier_{p}": two[f].get(p)
                                       for p in ("belady", "lru", "kvtier")},
                     **{f"one_tier_{p}": ours.get(key, {}).get(p) for p in ("belady", "lru")},
                     "one_tier_arc": theirs.get(key, {}).get("ARC"),
                     "one_tier_best_classical": best.get(key, {}).get("best"),
                     "one_tier_best_classical_rate": best.get(key, {}).get("best_rate"),
                     "one_tier_kvtier": ours.get(key, {}).get("kvtier")})
    return rows


_RETENTION_KEYS = ("block_reads", "reprefill_blocks", "reprefill_requests", "new_blocks",
                   "lookup_starts", "lookup_blocks", "retained_hits", "retained_chunks",
                   "freed_chunks", "sessions_ended", "reuse_fast_hit_rate")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", help="Mooncake-format JSONL trace (none: shapes only)")
    parser.add_argument("--shapes", default=",".join(shapes.SHAPES),
                        help="generated workloads to run after the trace (comma-separated, "
                             f"from {','.join(shapes.SHAPES)}; empty: none)")
    parser.add_argument("--shape-scale", type=float, default=1.0,
                        help="multiplies each shape's session count")
    parser.add_argument("--shape-policies", default=",".join(SHAPE_POLICIES))
    parser.add_argument("--replay-cost", type=float, default=REPLAY_COST_READS,
                        help="a window's replay in chunk reads: its weight in the headline "
                             "figure and in kvtier's policy")
    parser.add_argument("--limit", type=int, help="use only the first N requests")
    parser.add_argument("--layout", default="kvtier-bundled", help="layout spec for byte sizes")
    parser.add_argument("--fractions", type=_floats, default=list(DEFAULT_FRACTIONS),
                        help="hbm capacities as fractions of the unique block footprint")
    parser.add_argument("--host-ratio", type=float, default=4.0, help="host capacity / hbm")
    parser.add_argument("--disk-fraction", type=float, help="disk capacity (default unbounded)")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help=f"comma-separated, from {','.join(POLICIES)}")
    parser.add_argument("--hint-sigma", type=float, default=0.5, help="lognormal hint noise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validate", type=int, default=DEFAULT_VALIDATE_REQUESTS, metavar="N",
                        help="replay the first N requests through the real TierStack and "
                             "TierManager (0: no)")
    parser.add_argument("--validate-ttl", type=float, default=DEFAULT_VALIDATE_TTL_S,
                        help="the validation's session TTL, so that its prefix sees sessions "
                             "end and retained chunks come back (0: the run's)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--session-ttl", type=float, default=DEFAULT_SESSION_TTL_S,
                        help="seconds after its last request a session is deleted "
                             "(0: never)")
    parser.add_argument("--lookup-tokens", type=int, default=65536,
                        help="time Lookup of a prefix this long against its prefill with "
                             "the bundled model (bench.trace.lookup; 0: skip)")
    parser.add_argument("--policy-ranks-retained", action="store_true",
                        help="what-if: every policy ranks retained chunks itself (the "
                             "reuse policy always does; the others evict them first)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    try:
        report = run_benchmark(
            args.trace, shape_names=[n for n in args.shapes.split(",") if n],
            shape_policies=[p for p in args.shape_policies.split(",") if p],
            shape_scale=args.shape_scale, replay_cost=args.replay_cost,
            validate_ttl_s=args.validate_ttl or args.session_ttl or None,
            limit=args.limit, layout=args.layout, fractions=args.fractions,
            host_ratio=args.host_ratio, disk_fraction=args.disk_fraction,
            policies=[p for p in args.policies.split(",") if p], hint_sigma=args.hint_sigma,
            seed=args.seed, validate_requests=args.validate, jobs=args.jobs,
            session_ttl_s=args.session_ttl or None, lookup_tokens=args.lookup_tokens,
            retained_first=not args.policy_ranks_retained)
    except KVTierError as exc:
        print(f"bench.trace: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0

