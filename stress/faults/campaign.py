"""Fault campaign against the disk tier: power loss at every point, ENOSPC and EIO at every
call site, and a lost or damaged index repaired.

``python -m stress.faults --json [--workload small|large] [--seed N] [--per-kind K]``

- Power loss (``testing.power_loss``): the workload runs on a recorded file
  system; every prefix of its I/O log, in every crash variant (page cache kept, synced
  bytes only, last write torn), is reopened and checked. ``acked_lost``: durable acks
  that did not survive; ``wrong``: restores of bytes no allowed generation holds;
  ``recovery_failures``: a reopen, restore or new spill that raised.
- ``enospc`` and ``eio`` (``stress.faults.cases``): one case per call site kind and nth
  call, ``recovered`` when every error was a clear tier error, nothing acknowledged was
  lost and the tier served again once healed, without a reopen.
- ``repair`` (``stress.faults.repair_trials``): sessions restoring bit-exact before and after
  ``kvtier repair``'s library rebuilt a deleted index, and one with flipped bytes.

``--workload small`` is the size the tests use; ``large`` the one ``make bench`` reports.
With ``--json`` the exit status is 0 whenever the run finished (``summary.clean`` says
whether everything held); without it, 1 when something did not.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import time

from stress.faults import repair_trials
from stress.faults.cases import EIO_KINDS, ENOSPC_KINDS, run_cases
from testing.power_loss import large_workload, run_crash_campaign, small_workload

SIZES = {
    # crash workload; cases per call site kind; repair sessions and byte-flip trials
    "small": {"per_kind": 3, "sessions": 6, "trials": 2},
    "large": {"per_kind": 6, "sessions": 24, "trials": 8},
}
FLIPS = 16


def workload(size: str, seed: int):
    return small_workload() if size == "small" else large_workload(sessions=8, rounds=5,
                                                                   seed=seed)


def _timed(results: dict, name: str, run) -> None:
    started = time.perf_counter()
    results[name] = run()
    results.setdefault("stage_s", {})[name] = round(time.perf_counter() - started, 2)


def run(size: str = "small", seed: int = 0, per_kind: int | None = None,
        enospc_kinds=None, eio_kinds=None) -> dict:
    """Every part at ``size``; ``per_kind`` and the kinds narrow the fault cases."""
    sizes = SIZES[size]
    per_kind = per_kind or sizes["per_kind"]
    results: dict = {"workload": size, "seed": seed}
    _timed(results, "power_loss", lambda: run_crash_campaign(workload(size, seed), seed))
    campaign = results.pop("power_loss")
    results.update({k: campaign[k] for k in ("events", "crash_points", "images",
                                             "acked_durable", "acked_lost", "wrong",
                                             "recovery_failures")})
    results["power_loss_failures"] = campaign["failures"]
    _timed(results, "enospc", lambda: run_cases(
        errno.ENOSPC, enospc_kinds or ENOSPC_KINDS, per_kind))
    _timed(results, "eio", lambda: run_cases(
        errno.EIO, eio_kinds or EIO_KINDS, per_kind))
    _timed(results, "repair", lambda: {
        "deleted_index": repair_trials.deleted_index(sizes["sessions"]),
        "flipped_bytes": repair_trials.flipped_bytes(sizes["sessions"], sizes["trials"],
                                                     FLIPS, seed)})
    results["summary"] = summary(results)
    return results


def summary(results: dict) -> dict:
    cases = results["enospc"] + results["eio"]
    repaired = results["repair"].values()
    return {"cases": len(cases), "cases_recovered": sum(c["recovered"] for c in cases),
            "cases_fired": sum(c["fired"] > 0 for c in cases),
            "repair_bit_exact": all(r["bit_exact"] for r in repaired),
            "clean": (results["acked_lost"] == results["wrong"]
                      == results["recovery_failures"] == 0
                      and all(c["recovered"] for c in cases)
                      and all(r["bit_exact"] for r in repaired))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stress.faults",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--workload", choices=sorted(SIZES), default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-kind", type=int, help="fault cases per call site kind")
    args = parser.parse_args(argv)
    # the tier logs every torn record it discards and every failed call: thousands here
    logging.disable(logging.ERROR)
    results = run(args.workload, args.seed, args.per_kind)
    if args.json:
        print(json.dumps(results))
    else:
        s = results["summary"]
        print(f"power loss: {results['images']} images of {results['crash_points']} crash "
              f"points, {results['acked_durable']} durable acks owed, {results['acked_lost']} "
              f"lost, {results['wrong']} wrong, {results['recovery_failures']} recovery "
              f"failures; fault cases recovered {s['cases_recovered']}/{s['cases']}; "
              f"repair bit-exact: {s['repair_bit_exact']}")
    return 0 if args.json or results["summary"]["clean"] else 1

