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
                     f"{r['reuse_fast_hit_rate']:.3f}", f"{r['replays']}/{r['resumes']}"])
    out += table(["hbm fraction", "policy", "hbm", "host", "disk", "new", "re-prefill",
                  "fast (hbm+host)", "fast among re-reads", "replays/continuations"], rows)
    out += ["", *retention_lines(stage), *goal_lines(stage)]
    if "validation" in stage:
        v = stage["validation"]
        out += ["", f"Simulation checked against the real TierStack on the first "
                f"{v['requests']} requests: {'all counts agree' if v['agree'] else 'DIFFER'}."]
    return out + [""]


def goal_lines(stage: dict) -> list[str]:
    """The goals, kvtier next to libCacheSim on one tier, and Lookup's cost."""
    out: list[str] = []
    g = stage.get("goals")
    if g:
        share, lru = g["belady_share"], g["never_below_lru"]
        out += ["", "Goals (`kvtier` is the project's policy, `kvstore.eviction.reuse."
                "ReusePolicy`, with hints inferred from the past only):", ""]
        out += table(["goal", "measured", "met"], [
            *[[f"kvtier >= {share['target']:g} x Belady, fast among re-reads, hbm {f}",
               f"{v['kvtier']:.3f} / {v['belady']:.3f} = **{v['share']:.3f}**",
               "yes" if v["share"] >= share["target"] else "**no**"]
              for f, v in share["points"].items()],
            ["kvtier never below LRU", ", ".join(
                f"{f}: {v['kvtier']:.3f} vs {v['lru']:.3f}" for f, v in lru["points"].items()
                if None not in v.values()), "yes" if lru["met"] else
                f"**no** (at hbm {', '.join(lru['below_at'])})"],
            ["re-prefill with retention, unbounded disk < 1% of reads",
             f"{g['reprefill_with_retention']['rate']:.4f}",
             "yes" if g["reprefill_with_retention"]["met"] else "**no**"]])
    one = stage.get("one_tier")
    if one:
        lcs = one["libcachesim"].get("hit_rate_among_rereads", {})
        ours = one["hit_rate_among_rereads"]
        theirs = one["libcachesim"].get("policies", [])
        mine = list(next(iter(ours.values()), {}))
        out += ["", "One tier of equal-size blocks, prefix reads, hit rate among re-reads: "
                "kvtier's simulation (no window blobs, no host tier) next to libCacheSim "
                f"{one['libcachesim'].get('libcachesim', '')} on the same trace "
                "(`bench/trace/libcachesim.py`, committed `bench/trace_libcachesim.json`"
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

