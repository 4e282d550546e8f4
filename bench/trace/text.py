"""The plain-text form of ``bench.trace``'s result (what ``python -m bench.trace`` prints
without ``--json``): per policy and fraction the hit rates and tier counts, the goals, and
every workload shape's table."""

from __future__ import annotations

GOAL_KEYS = ("monotone", "never_below_lru", "belady_share", "one_tier_vs_best_classical",
             "belady_bound")

def format_table(report: dict) -> str:
    if "trace" not in report:  # shapes only
        return "\n".join(shapes_lines(report))
    t, lay = report["trace"], report["layout"]
    lines = [
        f"trace {t['path']}: {t['requests']} requests, {t['block_reads']} block reads, "
        f"{t['unique_blocks']} unique blocks, {t['sessions']} sessions, "
        f"{t['continuations']} continuations, {t['lookup_starts']} lookup starts",
        f"layout {lay['name']}: block {lay['block_bytes']} B, window {lay['window_bytes']} B; "
        f"footprint {report['footprint_bytes'] / 2**20:.1f} MiB; host = "
        f"{report['tiers']['host_ratio']:g} x hbm",
        "hit rates are fractions of block reads; fast = hbm + host; reuse-fast, own (same "
        "session) and shared (another's blocks) leave out first reads; replays: "
        "continuations without a window in hbm/host",
        "",
        f"{'hbm frac':>8} {'policy':<12} {'hbm':>6} {'host':>6} {'disk':>6} {'new':>6} "
        f"{'re-pf':>6} {'fast':>6} {'reuse-fast':>10} {'own':>6} {'shared':>6} {'replays':>9} "
        f"{'promo MiB':>9} {'demo MiB':>9}",
    ]
    for r in report["results"]:
        rate = r["block_hit_rate"]
        promo = sum(r["bytes_moved"]["promotion"].values()) / 2**20
        demo = sum(r["bytes_moved"]["demotion"].values()) / 2**20
        lines.append(
            f"{r['capacity_fraction']:>8g} {r['policy']:<12} {rate['hbm']:>6.3f} "
            f"{rate['host']:>6.3f} {rate['disk']:>6.3f} {rate['new']:>6.3f} "
            f"{rate['reprefill']:>6.3f} {r['fast_hit_rate']:>6.3f} "
            f"{r['reuse_fast_hit_rate']:>10.3f} "
            f"{r['reuse_by_kind']['same_session']['fast_hit_rate']:>6.3f} "
            f"{r['reuse_by_kind']['other_session']['fast_hit_rate']:>6.3f} "
            f"{r['replays']:>4}/{r['resumes']:<4} {promo:>9.1f} {demo:>9.1f}")
    ret = report["retention"]
    lines += ["", f"re-prefilled blocks / block reads, {ret['policy']} at hbm "
                  f"{ret['capacity_fraction']:g}: with retention "
                  f"{ret['with']['reprefill_blocks'] / ret['with']['block_reads']:.4f}, without "
                  f"{ret['without']['reprefill_blocks'] / ret['without']['block_reads']:.4f}"]
    lines += goal_line(report["goals"])
    if "lookup" in report:
        lk = report["lookup"]
        lines += [f"lookup of a {lk['tokens']}-token prefix: {lk['lookup_s'] * 1000:.2f} ms, "
                  f"prefill {lk['prefill_s']:.2f} s: {lk['lookup_vs_prefill']:.2e} of it "
                  f"(goal < {lk['goal_ratio']:g}: {_met(lk)})"]
    if "one_tier" in report:
        one, lcs = report["one_tier"], report["one_tier"]["libcachesim"]
        lines += ["", "one tier of equal-size blocks, hit rate among re-reads:"]
        for fraction, rates in one["hit_rate_among_rereads"].items():
            theirs = lcs.get("hit_rate_among_rereads", {}).get(fraction, {})
            lines.append(f"  {fraction:>5}: " + " ".join(f"{p} {v:.3f}" for p, v in rates.items())
                         + " | libCacheSim: " + (" ".join(f"{p} {v:.3f}"
                                                          for p, v in theirs.items())
                                                 or lcs.get("missing", "-")))
    if "validation" in report:
        v = report["validation"]
        lines += ["", f"validation, first {v['requests']} requests at hbm {v['hbm_fraction']:g} "
                      f"(session TTL "
                      f"{v['session_ttl_s']} s): "
                      f"{'all counts agree' if v['agree'] else 'counts DIFFER'}; covers "
                      + ", ".join(f"{k} {n}" for k, n in v["covers"].items())]
        for part, label in (("tier_stack", "TierStack"), ("manager", "TierManager")):
            lines += [f"  {label} {p['policy']}: {'agree' if p['agree'] else 'DIFFER'}"
                      for p in v[part]["points"]]
    lines += shapes_lines(report)
    lines += ["", "method:"] + [f"  {k}: {v}" for k, v in report["method"].items()]
    return "\n".join(lines)


def goal_line(g: dict) -> list[str]:
    below = g["never_below_lru"]["below_at"]
    out = ["goals (headline: fast value among re-reads): kvtier / belady, target >= "
           f"{g['belady_share']['target']:g}: " + ", ".join(
               f"hbm {f}: {v['share']:.3f}" for f, v in g["belady_share"]["points"].items())
           + f" ({_met(g['belady_share'])}); never below lru: {_met(g['never_below_lru'])}"
           + (f" (below at hbm {', '.join(below)})" if below else "")
           + f"; monotone: {_met(g['monotone'])}; one tier vs best classical: "
           f"{_met(g['one_tier_vs_best_classical'])}; Belady the bound: "
           + ("yes" if g["belady_bound"]["held"] else
              f"NO ({len(g['belady_bound']['violations'])} points above it: a bug)")]
    if "reprefill_with_retention" in g:
        out.append(f"re-prefill with retention {g['reprefill_with_retention']['rate']:.4f} "
                   f"({_met(g['reprefill_with_retention'])})")
    return out


def shapes_lines(report: dict) -> list[str]:
    lines = []
    for name, row in report.get("by_shape", {}).items():
        lines += ["", f"{name}: hbm frac | two-tier value Belady LRU kvtier | one tier "
                      "Belady LRU ARC best-classical kvtier"]
        for t in row["table"]:
            lines.append(f"  {t['fraction']:>5g} | " + " ".join(
                _num(t[f"two_tier_{p}"]) for p in ("belady", "lru", "kvtier")) + " | " + " ".join(
                _num(t[k]) for k in ("one_tier_belady", "one_tier_lru", "one_tier_arc",
                                     "one_tier_best_classical_rate", "one_tier_kvtier"))
                + f" ({t['one_tier_best_classical'] or '-'})")
        lines += goal_line({k: row[k] for k in GOAL_KEYS})
    return lines


def _num(value: float | None) -> str:
    return "  -  " if value is None else f"{value:.3f}"


def _met(goal: dict) -> str:
    return {True: "met", False: "NOT met", None: "not measured"}[goal["met"]]
