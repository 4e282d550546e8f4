"""The REPORT.md section of ``stress.faults`` (``bench.report`` calls ``section``):
power loss, ENOSPC and EIO per call site, and index repair."""

from __future__ import annotations

from stress.markdown import table


def section(stage: dict) -> list[str]:
    out = ["## Faults (`python -m stress.faults`)", "",
           f"Power loss, workload `{stage['workload']}` (seed {stage['seed']}): "
           f"{stage['events']} file-system events, {stage['crash_points']} crash points, "
           f"{stage['images']} distinct crash images reopened; {stage['acked_durable']} "
           f"durable acks owed, **{stage['acked_lost']} lost**, {stage['wrong']} wrong "
           f"restores, {stage['recovery_failures']} recovery failures.", "",
           "ENOSPC (a full disk until healed) and EIO (one failing call) at the nth call "
           "of each kind, spread over the calls a healthy phase makes; recovered: clear "
           "tier errors only, nothing acknowledged lost, serving again once healed with "
           "no reopen.", ""]
    rows = []
    for name in ("enospc", "eio"):
        kinds: dict[str, list[dict]] = {}
        for case in stage[name]:
            kinds.setdefault(case["kind"], []).append(case)
        for kind, cases in kinds.items():
            errors: dict[str, int] = {}
            for case in cases:
                for error, count in case["errors"].items():
                    errors[error] = errors.get(error, 0) + count
            rows.append([name.upper(), kind, ", ".join(str(c["nth"]) for c in cases),
                         f"{sum(c['fired'] > 0 for c in cases)}/{len(cases)}",
                         f"{sum(c['recovered'] for c in cases)}/{len(cases)}",
                         ", ".join(f"{e} {n}" for e, n in sorted(errors.items())) or "-"])
    out += table(["fault", "call", "nth calls", "fired", "recovered", "errors met"], rows)
    rows = [[variant.replace("_", " "), r["sessions_before"], r["sessions_after"],
             r["bit_exact"], r["orphans"],
             r.get("open_before_repair") or f"opened {r['opened']}, refused {r['refused']}, "
                                           f"crashed {r['crashed']} of {r['trials']}"]
            for variant, r in stage["repair"].items()]
    out += ["", "Index repair (`kvstore.compaction.index_repair`, as `kvtier repair` runs it); "
            f"flipped bytes: {stage['repair']['flipped_bytes']['flips']} seeded bit flips in "
            "data.mdb per trial, the damaged open in a child process:", ""]
    out += table(["damage", "sessions before", "sessions restored after",
                  "bit-exact", "orphan chunks", "writer open before repair"], rows)
    return out + [""]

