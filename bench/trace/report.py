"""The REPORT.md section of ``bench.trace`` (``bench.report`` calls ``section``; its plot
is ``bench.report_plots.plot_trace``): hit rates per policy, retention, the goals,
libCacheSim on one tier and a Lookup's cost."""

from __future__ import annotations

from stress.markdown import table


def section(stage: dict) -> list[str]:
    t = stage["trace"]
    out = ["## Hit rate on a request trace (`python -m bench.trace`)", "",
           f"Trace `{t['path']}`: {t['requests']} requests, {t['block_reads']} block reads, "
           f"{t['unique_blocks']} unique blocks, {t['sessions']} sessions, "
           f"{t['continuations']} continuations, {t['lookup_starts']} new sessions started "
           f"from a looked-up prefix. Layout {stage['layout']['name']}: block "
           f"{stage['layout']['block_bytes']} B, window {stage['layout']['window_bytes']} B. "
           "Method: see `bench/trace/run.py` (repeated under `method` in results.json).", "",
           "![hit rate](trace_hit_rate.png)", ""]
    rows = []
    for r in stage["results"]:
        rate = r["block_hit_rate"]
        rows.append([r["capacity_fraction"], r["policy"], f"{rate['hbm']:.3f}",
                     f"{rate['host']:.3f}", f"{rate['disk']:.3f}", f"{rate['new']:.3f}",
                     f"{rate['reprefill']:.3f}", f"{r['fast_hit_rate']:.3f}",
                     f"{r['reuse_fast_hit_rate']:.3f}", f"{r['reuse_fast_value']:.3f}",
                     f"{r['replays']}/{r['resumes']}"])
    out += table(["hbm fraction", "policy", "hbm", "host", "disk", "new", "re-prefill",
                  "fast (hbm+host)", "fast among re-reads", "headline (windows as replays)",
                  "replays/continuations"], rows)
    out += ["", *retention_lines(stage), *goal_lines(stage)]
    if "validation" in stage:
        v = stage["validation"]
        out += ["", f"Simulation checked against the real TierStack and TierManager on the "
                f"first {v['requests']} requests (session TTL {v['session_ttl_s']:g} s): "
                f"{'all counts agree' if v['agree'] else 'DIFFER'}; it covered "
                + ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in v["covers"].items())
                + ("" if v["covers_all"] else " (NOT all of them)") + "."]
    return out + [""]


def goal_lines(stage: dict) -> list[str]:
    """The goals of every workload (the trace and each shape), their tables (two tiers:
    Belady, LRU, kvtier; one tier: Belady, LRU, ARC, the best classical policy, kvtier),
    kvtier next to libCacheSim on one tier, and Lookup's cost."""
    out: list[str] = []
    by_shape = stage.get("by_shape", {})
    if by_shape:
        met = stage.get("all_shapes_met", {})
        out += ["", "### Every workload: goals and tables", "",
                "Headline figure (two tiers, hbm + host over disk): hbm + host hits among "
                "re-reads, each resume's window weighed as "
                f"{stage.get('replay_cost', 0):g} chunk reads (what a replay costs); one "
                "tier: equal-size blocks, no windows, hit rate among re-reads, next to "
                "libCacheSim's policies on the same reads. `kvtier` is the project's "
                "policy, `kvstore.eviction.reuse.ReusePolicy`, with hints inferred from the "
                "past only. Shapes: `bench.trace.shapes` (parameters and seeds in "
                "results.json under each shape).", ""]
        out += table(["goal", *by_shape, "all"], [
            [label, *[_yes(row[key]["met"]) for row in by_shape.values()], _yes(met.get(key))]
            for key, label in (("monotone", "kvtier monotone in capacity"),
                               ("never_below_lru", "kvtier never below LRU"),
                               ("belady_share", "kvtier >= 0.95 x Belady (two tiers)"),
                               ("one_tier_vs_best_classical",
                                "one tier: kvtier >= best libCacheSim policy"),
                               ("belady_bound", "Belady above every policy"))])
        for name, row in by_shape.items():
            shares = row["belady_share"]["points"]
            out += ["", f"**{name}**", ""]
            out += table(["hbm", "Belady", "LRU", "kvtier", "kvtier / Belady",
                          "1 tier: Belady", "LRU", "ARC", "best classical", "kvtier"],
                         [[f"{t['fraction']:g}", _n(t["two_tier_belady"]), _n(t["two_tier_lru"]),
                           _n(t["two_tier_kvtier"]),
                           _n(shares.get(f"{t['fraction']:g}", {}).get("share")),
                           _n(t["one_tier_belady"]), _n(t["one_tier_lru"]),
                           _n(t["one_tier_arc"]),
                           f"{_n(t['one_tier_best_classical_rate'])} "
                           f"({t['one_tier_best_classical'] or '-'})",
                           _n(t["one_tier_kvtier"])] for t in row["table"]])
            bound = row["belady_bound"]
            if not bound["held"]:
                out += ["", "Belady is NOT above every policy here (a bug): " + "; ".join(
                    f"{v['policy']} {v['policy_rate']:.4f} > {v['belady']:.4f} at "
                    f"{v['fraction']:g} ({v['view']})" for v in bound["violations"])]
    g = stage.get("goals", {})
    if "reprefill_with_retention" in g:
        r = g["reprefill_with_retention"]
        out += ["", f"Re-prefill with retention and an unbounded disk: {r['rate']:.4f} of "
                f"block reads (goal < {r['target']:g}: {_yes(r['met'])})."]
    one = stage.get("one_tier")
    if one:
        lcs = one["libcachesim"].get("hit_rate_among_rereads", {})
        ours = one["hit_rate_among_rereads"]
        theirs = one["libcachesim"].get("policies", [])
        mine = list(next(iter(ours.values()), {}))
        out += ["", "One tier of equal-size blocks on the trace, every libCacheSim policy run "
                f"(libCacheSim {one['libcachesim'].get('libcachesim', '')}, "
                "`bench/trace/libcachesim.py`, committed `bench/trace_libcachesim.json`"
                f"{'' if lcs else ': ' + one['libcachesim'].get('missing', '')}).", ""]
        out += table(["cache size", *[f"sim {p}" for p in mine], *theirs],
                     [[f"{float(f):.0%}", *[f"{ours[f][p]:.3f}" for p in mine],
                       *[f"{lcs.get(f, {}).get(p, float('nan')):.3f}" for p in theirs]]
                      for f in ours])
    lk = stage.get("lookup")
    if lk:
        out += ["", f"Lookup of a {lk['tokens']}-token prefix (bundled model, same run, "
                f"`bench.trace.lookup`): {lk['lookup_s'] * 1000:.2f} ms against "
                f"{lk['prefill_s']:.1f} s to prefill it: **{lk['lookup_vs_prefill']:.1e}** of "
                f"the prefill (goal < {lk['goal_ratio']:g}: "
                f"{'met' if lk['met'] else 'NOT met'})."]
    return out


def _disk(fraction: float | None) -> str:
    return "unbounded" if fraction is None else f"{fraction:g} x footprint"


def retention_lines(stage: dict) -> list[str]:
    ret = stage["retention"]
    rates = {k: ret[k]["reprefill_blocks"] / ret[k]["block_reads"] for k in ("with", "without")}
    ttl = stage["trace"]["session_ttl_s"]
    return [f"Re-prefilled blocks / block reads ({ret['policy']}, hbm "
            f"{ret['capacity_fraction']:g}, disk {_disk(stage['tiers']['disk_fraction'])}, "
            f"sessions deleted {f'{ttl:g} s' if ttl else 'never'} after their last request): "
            f"with retention **{rates['with']:.4f}** ({ret['with']['retained_hits']} "
            f"looked-up reads of retained chunks), without **{rates['without']:.4f}** "
            f"({ret['without']['freed_chunks']} chunks freed)."]



def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _yes(met: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "not measured"}[met]
