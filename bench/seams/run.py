"""A whole simulation: the shared processes (redis-server, moto's S3 server, a
development set of TLS certificates and tokens), then each switch combination in turn,
the step budget shared among those that serve; the result as one JSON-able dict."""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from pathlib import Path

from bench.seams.engine import Simulation
from bench.seams.switches import Combination
from bench.seams.verdict import KEYS, Ledger
from bench.seams.world import Moto, Redis, reap
from testing.live_server import Credentials

MIN_STEPS = 20  # per combination, whatever the budget


def simulate(steps: int, seed: int, combinations: list[Combination], *,
             workdir: Path | None = None, log_path: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvtier-seams-") as scratch:
        root = Path(workdir or scratch)
        root.mkdir(parents=True, exist_ok=True)
        # the step log outlives a scratch directory: findings are replayed from it
        log_path = log_path or (root / "seams.log" if workdir else
                                Path(tempfile.gettempdir()) / f"kvtier-seams-{seed}.log")
        log_file = open(log_path, "a", buffering=1)  # noqa: SIM115
        previous = signal.signal(signal.SIGTERM, _exit_on_term)
        try:
            began = time.monotonic()
            result = asyncio.run(_simulate(
                steps, seed, combinations, root,
                lambda line: log_file.write(f"t={time.monotonic() - began:.1f} {line}\n")))
            return {**result, "log": str(log_path)}
        finally:
            signal.signal(signal.SIGTERM, previous)
            reap()
            log_file.close()


def _exit_on_term(signum, frame) -> None:
    # SIGTERM unwinds like Ctrl-C: servers stopped, tmpfs unmounted, processes ended
    raise SystemExit(128 + signum)


async def _simulate(steps: int, seed: int, combinations: list[Combination], root: Path,
                    log) -> dict:
    started = time.monotonic()
    ledger = Ledger(seed, log)
    redis, moto = Redis(root / "redis"), Moto(root / "moto.log")
    creds = Credentials.write(root / "creds")
    results = []
    # The most crossed first: a combination its server refuses leaves its share of the
    # budget to those after it.
    order = sorted(combinations, key=lambda c: -sum(vars(c).values()))
    try:
        await asyncio.to_thread(redis.start)
        await asyncio.to_thread(moto.start)
        planned = 0  # the shares of those that served (their verifications come on top)
        for i, combo in enumerate(order):
            share = max(MIN_STEPS, (steps - planned) // (len(order) - i))
            log(f"seed={seed} combo={combo.name} steps={share}")
            sim = Simulation(combo, seed, share, workdir=root, redis=redis, moto=moto,
                             creds=creds, ledger=ledger, log=log)
            results.append(await sim.run())
            planned += share if results[-1]["ran"] else 0
    finally:
        moto.stop()
        redis.stop()
    stalls_sources = sorted({r["stalls"]["source"] for r in results if r["stalls"]["source"]})
    return {
        "steps": sum(r["steps"] for r in results),
        "switch_combinations": sum(r["ran"] for r in results),
        "combinations_tried": len(results),
        **{key: ledger.counts[key] for key in KEYS},
        "stalls_source": ", ".join(stalls_sources),
        "seed": seed,
        "seconds": round(time.monotonic() - started, 1),
        "per_combination": results,
        "findings": ledger.report(),
    }
