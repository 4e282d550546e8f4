"""The REPORT.md section of ``stress.fuzz`` (``bench.report`` calls ``section``): the
campaign's counts, plain and against TLS with tokens."""

from __future__ import annotations

from stress.markdown import table


def section(stage: dict) -> list[str]:
    out = ["## Fuzz (`python -m stress.fuzz`)", "",
           f"{stage['requests']} requests (seed {stage['seed']}) to every KVTier and Replay "
           "method of a live server and replay worker over raw stubs: random bytes, truncated "
           "and random messages, bombs, wrong section tables, huge ids and token counts, bad "
           "digests, foreign and path-like lease ids, out-of-vocabulary ids, stale and "
           "duplicate generations, Spill messages out of order, streams abandoned or left "
           "silent; hostile layouts for RegisterLayout (nesting, floats, huge dims, floods "
           "up to the bounds), ListLayouts, Lookups of up to 15M tokens and of other "
           "tenants' prompts, Forks past the source, onto itself and across tenants; "
           f"{stage['probes']} probes spilled and restored through the client "
           f"between them. {stage['seconds']} s.", ""]
    columns = ["crashes", "hangs", "INTERNAL/UNKNOWN (client / server count)",
               "wrong tensors", "pre-existing sessions intact", "server peak RSS"]
    row = [stage["crashes"], stage["hangs"],
           f"{stage['internal_or_unknown']} / {stage['server_internal_or_unknown']}",
           stage["wrong_tensors"], stage["preexisting_sessions_intact"],
           f"{stage['server_peak_rss_mib']:.0f} MiB"]
    if "prefix_leaks" in stage:  # a prefix found by another tenant; a path in an answer
        columns += ["prefix leaks", "path leaks", "loop stalls (slowest Stat)"]
        row += [stage["prefix_leaks"], stage["path_leaks"],
                f"{stage['stalls']} ({stage['stat_max_s']:.2f} s)"]
    out += table(columns, [row])
    out += ["", "Status codes: " + ", ".join(f"{code} {count}" for code, count
                                               in stage["by_code"].items())
            + " (CANCELLED: streams the fuzzer abandoned; CLIENT_WRITE_RACE: the server ended "
            "a client stream while the fuzzer was still writing, which grpc's aio client "
            "reports as its own INTERNAL, grpc/grpc#36066: the server's own count is the "
            "second INTERNAL figure).", ""]
    if auth := stage.get("authenticated"):
        out += [f"Against a server with TLS and bearer tokens (`--auth`): {auth['requests']} "
                f"requests, {auth['credential_attacks']} of them credential attacks (no token, "
                "a forged token, another tenant's session named with a valid one): "
                f"{auth['credential_breaches']} breaches, {auth['crashes']} crashes, "
                f"{auth['hangs']} hangs, {auth['internal_or_unknown']} INTERNAL/UNKNOWN, "
                f"{auth['wrong_tensors']} wrong tensors, pre-existing sessions intact: "
                f"{auth['preexisting_sessions_intact']}.", ""]
    return out

