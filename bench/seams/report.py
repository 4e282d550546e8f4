"""The REPORT.md section of ``bench.seams`` (``bench.report`` calls ``section``): the
failure keys per switch combination, and the first findings."""

from __future__ import annotations

from bench.seams.verdict import KEYS

SHOWN = 15  # findings listed in the report; results.json holds the first 50


def section(stage: dict) -> list[str]:
    out = ["## Seams (`python -m bench.seams`)", "",
           f"The whole-service simulation, seed {stage['seed']}: {stage['steps']} steps over "
           f"{stage['switch_combinations']} of {stage['combinations_tried']} switch "
           "combinations (encryption, quotas, retention, shared metadata, TLS with tokens) "
           "that served, against real `kvtier serve` processes, redis-server and moto's S3 "
           "server, every restore and prefix-chunk read checked against a reference model; "
           "restarts (SIGTERM and kill -9), offline and live compaction, repair, migrate, "
           "backup and restore-backup (damaged at times), the online CLI tools, a live "
           "tokens file, a routed client with a hung node, a remote replay worker and a full "
           f"tmpfs between the operations. {stage['seconds']} s. Stalls from: "
           f"{stage.get('stalls_source') or '-'}.", ""]
    out += ["| failure key | count |", "|---|---|"]
    out += [f"| {key} | {stage[key]} |" for key in KEYS]
    out += ["", "| combination | steps | server starts | " + " | ".join(KEYS) + " |",
            "|" + "---|" * (3 + len(KEYS))]
    for c in stage["per_combination"]:
        steps = c["steps"] if c["ran"] else "refused"
        out.append(f"| {c['combination']} | {steps} | {c['server_starts']} | "
                   + " | ".join(str(c[key]) for key in KEYS) + " |")
    findings = stage.get("findings", [])
    if findings:
        out += ["", f"First findings (of {sum(stage[k] for k in KEYS)}; seed, step and op "
                "replay each):", ""]
        out += [f"- {f['kind']}: {f['combination']} step {f['step']} `{f['op']}` "
                f"{f['session']}: expected {f['expected']}, got {f['got']}".replace("|", "/")
                for f in findings[:SHOWN]]
    return out + [""]
