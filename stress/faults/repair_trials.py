"""The disk index lost or damaged, then rebuilt by ``kvstore.compaction.index_repair``.

    from stress.faults.repair_trials import deleted_index, flipped_bytes
    deleted_index(sessions=12)                     # a dict
    flipped_bytes(sessions=12, trials=4, flips=16, seed=0)

Both spill ``sessions`` sessions durably through a ``TierManager`` over a ``DiskTier``
(two more are spilled and deleted), close it, and damage the LMDB environment:
``deleted_index`` removes it (``index/``), ``flipped_bytes`` flips seeded random bits in
``index/data.mdb``, one copy of the directory per trial. Opening the damaged tier as a
writer must either work or raise IndexCorrupt; for byte flips that open runs in a
child process, because an assertion in LMDB's mdb.c aborts the process it runs in
(``crashed`` counts trials where the child died). Then the repair library runs and
the tier is reopened: ``sessions_after`` counts sessions that restore bit-exact,
``deleted_back`` deleted sessions that came back, ``orphans`` the chunks the repair
found no manifest for.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvstore.compaction.index_repair import repair
from kvstore.format.errors import IndexCorrupt, KVTierError, SessionNotFound
from kvstore.session.manager import TierManager
from kvstore.tiers.disk import DiskTier
from testing.power_loss import (
    TENANT,
    Spill,
    crash_layout,
    restores_exactly,
    session_args,
)

ROOT = Path(__file__).resolve().parents[2]
CAPACITY = 1 << 26
SEGMENT_BYTES = 16 << 10
DELETED = ("gone0", "gone1")

# Prints "opened", "corrupt <message>", or dies by a signal (an mdb.c abort).
_OPEN_CHILD = """
import sys
from kvstore.format.errors import IndexCorrupt
from kvstore.tiers.disk import DiskTier
try:
    DiskTier(sys.argv[1], 1 << 26)
except IndexCorrupt as exc:
    print("corrupt", exc)
else:
    print("opened")
"""


def _steps(sessions: int) -> list[Spill]:
    return [Spill(f"s{i}", 1, 40 + 29 * i % 200) for i in range(sessions)]


async def build(path: Path, sessions: int) -> dict[str, dict]:
    """Spill the sessions (and the deleted ones) durably; the kept ones' arguments."""
    spec = crash_layout()
    kept = {step.session: session_args(spec, step) for step in _steps(sessions)}
    disk = DiskTier(path, CAPACITY, segment_bytes=SEGMENT_BYTES)
    manager = await TierManager.open([disk], disk.meta)
    try:
        for name, args in kept.items():
            await manager.spill(TENANT, name, generation=1, ack="durable", **args)
        for name in DELETED:
            args = session_args(spec, Spill(name, 1, 50))
            await manager.spill(TENANT, name, generation=1, ack="durable", **args)
            await manager.delete(TENANT, name)
    finally:
        await manager.close()
    return kept


async def count_restored(path: Path, kept: dict[str, dict]) -> dict:
    """Reopen the tier; how many kept sessions restore bit-exact, deleted ones came back."""
    disk = DiskTier(path, CAPACITY, segment_bytes=SEGMENT_BYTES)
    manager = await TierManager.open([disk], disk.meta)
    exact = back = 0
    try:
        for name, args in kept.items():
            try:
                exact += restores_exactly(await manager.restore(TENANT, name), args)
            except KVTierError:
                continue
        for name in DELETED:
            try:
                await manager.restore(TENANT, name)
            except SessionNotFound:
                continue
            back += 1
    finally:
        await manager.close()
    return {"sessions_after": exact, "deleted_back": back}


def _opens_in_process(path: Path) -> str:
    try:
        asyncio.run(DiskTier(path, CAPACITY).close())
    except IndexCorrupt:
        return "corrupt"
    return "opened"


def opens_in_child(path: Path) -> str:
    """Open the tier as a writer in a child: "opened", "corrupt" (IndexCorrupt), or
    "crashed (exit N)" when the child died (an mdb.c abort)."""
    child = subprocess.run([sys.executable, "-c", _OPEN_CHILD, str(path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    if child.returncode:
        return f"crashed (exit {child.returncode})"
    return child.stdout.split()[0] if child.stdout else "no output"


def _repaired(path: Path, kept: dict[str, dict], opened: str) -> dict:
    report = repair(path)
    counts = asyncio.run(count_restored(path, kept))
    return {"open_before_repair": opened, "sessions_before": len(kept), **counts,
            "bit_exact": counts["sessions_after"] == len(kept) and not counts["deleted_back"],
            "orphans": len(report.orphans), "incomplete": len(report.incomplete),
            "repair_s": round(report.seconds, 3)}


def deleted_index(sessions: int = 12) -> dict:
    """Remove the whole LMDB environment, repair, reopen."""
    with tempfile.TemporaryDirectory(prefix="kvtier-repair-") as workdir:
        path = Path(workdir) / "disk"
        kept = asyncio.run(build(path, sessions))
        shutil.rmtree(path / "index")
        return _repaired(path, kept, _opens_in_process(path))


def flipped_bytes(sessions: int = 12, trials: int = 4, flips: int = 16, seed: int = 0) -> dict:
    """Per trial, flip ``flips`` seeded random bits of data.mdb, then open, repair, reopen;
    the totals and every trial."""
    with tempfile.TemporaryDirectory(prefix="kvtier-repair-") as workdir:
        pristine = Path(workdir) / "pristine"
        kept = asyncio.run(build(pristine, sessions))
        runs = []
        for trial in range(trials):
            path = Path(workdir) / f"trial{trial}"
            shutil.copytree(pristine, path)
            data = path / "index" / "data.mdb"
            raw = bytearray(data.read_bytes())
            rng = random.Random(seed * 100_003 + trial)
            for _ in range(flips):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            data.write_bytes(bytes(raw))
            runs.append(_repaired(path, kept, opens_in_child(path)))
            shutil.rmtree(path)
    opened = [r["open_before_repair"] for r in runs]
    return {"trials": trials, "flips": flips, "seed": seed, "sessions_before": len(kept),
            "sessions_after": min(r["sessions_after"] for r in runs),
            "bit_exact": all(r["bit_exact"] for r in runs),
            "orphans": max(r["orphans"] for r in runs),
            "opened": opened.count("opened"), "refused": opened.count("corrupt"),
            "crashed": sum(o.startswith("crashed") for o in opened), "runs": runs}
