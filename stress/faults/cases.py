"""ENOSPC and EIO at each call site of the disk tier, one case per (kind, nth call).

    from stress.faults.cases import run_cases
    cases = run_cases(errno.EIO, ["write", "read"], per_kind=3)   # a list of dicts

A case drives a ``TierManager`` over one ``DiskTier`` whose file system is a
``FaultyFileSystem`` (``testing.faultfs``). Three sessions are spilled
durably while healthy; then the fault is armed and a phase runs: six new sessions
spilled durably, two old ones deleted, every acknowledged session restored, the
SEALED segments rewritten (a compaction: reads, writes, fsyncs, unlinks) and one more
spill. ENOSPC stays until healed (a full disk); EIO fails one call. A truncation only
follows a failed write, so a ``truncate`` case fails the ``nth`` write as well.
The ``nth`` values are spread over the calls of that kind a healthy phase makes
(counted in a dry run; ``fired`` says whether the fault was hit).

A case has ``recovered: true`` when every error the phase met was TierFull,
TierUnavailable or DataLoss (``clear``; anything else, a ValueError or a bare OSError,
would reach a client as INTERNAL), no restore returned other bytes (``wrong``), once
healed (and past the manager's short cooldown of a failed tier) the same manager
took a new durable spill and restored every acknowledged session bit-exact with no
reopen (``served_after_heal``), and after a reopen every
acknowledged session restored bit-exact and every acknowledged delete stayed deleted
(``lost``: those that did not).
"""

from __future__ import annotations

import asyncio
import errno
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstore.format.errors import DataLoss, SessionNotFound, TierFull, TierUnavailable
from kvstore.session.manager import ManagerConfig, TierManager
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.index import SegState
from testing.faultfs import FaultyFileSystem
from testing.power_loss import (
    TENANT,
    Spill,
    crash_layout,
    restores_exactly,
    session_args,
)

ENOSPC_KINDS = ("write", "fsync", "dirsync", "open", "truncate")
EIO_KINDS = ("write", "fsync", "dirsync", "open", "truncate", "read", "unlink")
CLEAR = (TierFull, TierUnavailable, DataLoss)
SEGMENT_BYTES = 4096  # small: the phase rolls segments (open, dirsync) and seals some
CAPACITY = 1 << 26
# The manager skips a tier that failed for this long (placement.py); short here, and
# waited out after healing: what "served again" means for a live manager.
COOLDOWN_S = 0.05
BEFORE = [Spill(f"b{i}", 1, 40 + 13 * i) for i in range(3)]
DURING = [Spill(f"n{i}", 1, 24 + 11 * i) for i in range(6)]
LAST = Spill("n6", 1, 50)
AFTER = Spill("after-heal", 1, 33)


@dataclass
class CaseResult:
    kind: str
    errno: str
    nth: int
    fired: int = 0  # failures the fault raised
    errors: dict[str, int] = field(default_factory=dict)  # clear errors met, by class
    unclear: list[str] = field(default_factory=list)  # any other exception, described
    acked: int = 0  # sessions acknowledged durable (or deleted) that must survive
    wrong: int = 0
    lost: int = 0
    served_after_heal: bool = False
    recovered: bool = False
    problems: list[str] = field(default_factory=list)


class _Run:
    """One case's manager, the sessions it acknowledged and what it met."""

    def __init__(self, disk: DiskTier, manager: TierManager, result: CaseResult) -> None:
        self.disk, self.manager, self.result = disk, manager, result
        self.spec = crash_layout()
        self.stored: dict[str, dict] = {}  # acknowledged durable: must restore exactly
        self.unsure: dict[str, dict] = {}  # spill or delete failed: may be absent
        self.deleted: set[str] = set()  # delete acknowledged: must stay deleted

    async def attempt(self, what: str, step) -> bool:
        try:
            await step()
        except CLEAR as exc:
            name = type(exc).__name__
            self.result.errors[name] = self.result.errors.get(name, 0) + 1
            return False
        except Exception as exc:  # noqa: BLE001 - an unclear error is what we count
            self.result.unclear.append(f"{what}: {exc!r}")
            return False
        return True

    async def spill(self, step: Spill) -> None:
        args = session_args(self.spec, step)
        ok = await self.attempt(f"spill {step.session}", lambda: self.manager.spill(
            TENANT, step.session, generation=1, ack="durable", **args))
        (self.stored if ok else self.unsure)[step.session] = args

    async def delete(self, session: str) -> None:
        args = self.stored.pop(session)
        if await self.attempt(f"delete {session}", lambda: self.manager.delete(TENANT,
                                                                               session)):
            self.deleted.add(session)
        else:
            self.unsure[session] = args

    async def restore(self, session: str, args: dict, must: bool) -> bool:
        """Restore ``session``; False when it did not give its bytes. Wrong bytes are
        counted; a failure is a problem only when ``must`` (any error but a clear one,
        SessionNotFound included, is unclear either way)."""
        outcome: list = []

        async def step():
            outcome.append(await self.manager.restore(TENANT, session))

        ok = await self.attempt(f"restore {session}", step)
        if ok and not restores_exactly(outcome[0], args):
            self.result.wrong += 1
            self.result.problems.append(f"{session} restored other bytes")
            return False
        if not ok and must:
            self.result.problems.append(f"{session} did not restore")
        return ok

    async def compact(self) -> None:
        sealed = [s.seg_id for s in self.disk.segments()
                  if s.state == SegState.SEALED and s.live_records]
        if sealed:
            await self.attempt("compaction", lambda: self.disk.rewrite_segments(sealed))

    async def phase(self) -> None:
        for step in DURING:
            await self.spill(step)
        for session in ("b0", "b1"):
            await self.delete(session)
        for session, args in sorted(self.stored.items()):
            await self.restore(session, args, must=False)  # a read fault may fail it
        await self.compact()
        await self.spill(LAST)


async def _open(path: Path, fs=None) -> tuple[DiskTier, TierManager]:
    disk = DiskTier(path, CAPACITY, segment_bytes=SEGMENT_BYTES,
                    **({"fs": fs} if fs is not None else {}))
    try:
        return disk, await TierManager.open(
            [disk], disk.meta, config=ManagerConfig(unavailable_cooldown_s=COOLDOWN_S))
    except BaseException:
        await disk.close()
        raise


def _arm(fs: FaultyFileSystem, kind: str, code: int, nth: int) -> None:
    times = None if code == errno.ENOSPC else 1  # a full disk stays full until healed
    if kind == "truncate":
        fs.fail("write", code, nth=nth, times=times)
        fs.fail("truncate", code, times=times)
    else:
        fs.fail(kind, code, nth=nth, times=times)


async def _settled(run: _Run, after: dict | None) -> int:
    """Lost sessions: acknowledged ones that do not restore exactly, acknowledged
    deletes that came back; unsure ones may be absent but never wrong."""
    lost = 0
    for session, args in sorted(run.stored.items()):
        if not await run.restore(session, args, must=True):
            lost += 1
    if after is not None and not await run.restore(AFTER.session, after, must=True):
        lost += 1
    for session, args in sorted(run.unsure.items()):
        try:
            got = await run.manager.restore(TENANT, session)
        except (SessionNotFound, DataLoss):
            continue
        if not restores_exactly(got, args):
            run.result.wrong += 1
            run.result.problems.append(f"unacknowledged {session} restored other bytes")
    for session in sorted(run.deleted):
        try:
            await run.manager.restore(TENANT, session)
        except SessionNotFound:
            continue
        lost += 1
        run.result.problems.append(f"deleted {session} came back")
    return lost


async def run_case(kind: str, code: int, nth: int, path: Path) -> CaseResult:
    result = CaseResult(kind, errno.errorcode[code], nth)
    fs = FaultyFileSystem()
    disk, manager = await _open(path, fs)
    run = _Run(disk, manager, result)
    try:
        for step in BEFORE:
            await run.spill(step)
        _arm(fs, kind, code, nth)
        await run.phase()
        result.fired = sum(fs.injected.values())
        fs.heal()
        await asyncio.sleep(COOLDOWN_S)
        after = session_args(run.spec, AFTER)
        served = await run.attempt("spill after heal", lambda: manager.spill(
            TENANT, AFTER.session, generation=1, ack="durable", **after))
        unclear_before = len(result.unclear)
        result.served_after_heal = served and await _settled(run, after) == 0 and len(
            result.unclear) == unclear_before
    finally:
        await manager.close()
    result.acked = len(run.stored) + len(run.deleted) + 1
    disk, run.manager = await _open(path)
    try:
        result.lost = await _settled(run, after if served else None)
    finally:
        await run.manager.close()
    result.recovered = (not result.unclear and result.wrong == 0 and result.lost == 0
                        and result.served_after_heal)
    del result.problems[10:]
    return result


async def count_calls(path: Path) -> Counter[str]:
    """Calls of each kind a healthy phase makes (what ``nth`` ranges over)."""
    fs = FaultyFileSystem()
    disk, manager = await _open(path, fs)
    run = _Run(disk, manager, CaseResult("none", "none", 0))
    try:
        for step in BEFORE:
            await run.spill(step)
        before = Counter(fs.calls)
        await run.phase()
    finally:
        await manager.close()
    return Counter(fs.calls) - before


def spread(calls: int, count: int) -> list[int]:
    """Up to ``count`` call numbers evenly spaced from 1 to nine tenths of ``calls``: how
    many fsyncs and opens a phase makes varies a little with group-commit timing, so a
    case at the very last call might never fire."""
    calls = max(1, calls * 9 // 10) if calls > 0 else 0
    if calls <= 0:
        return []
    if count >= calls:
        return list(range(1, calls + 1))
    if count == 1:
        return [1]
    return sorted({1 + round(i * (calls - 1) / (count - 1)) for i in range(count)})


async def cases(code: int, kinds, per_kind: int, workdir: Path) -> list[dict]:
    calls = await count_calls(workdir / "dry-run")
    out = []
    for kind in kinds:
        base = "write" if kind == "truncate" else kind
        for nth in spread(calls[base], per_kind):
            case = await run_case(kind, code, nth, workdir / f"{kind}-{nth}")
            out.append(asdict(case))
    return out


def run_cases(code: int, kinds=None, per_kind: int = 6) -> list[dict]:
    """Every (kind, nth) case of ``code`` (ENOSPC or EIO) as dicts; its own event loop."""
    kinds = kinds or (ENOSPC_KINDS if code == errno.ENOSPC else EIO_KINDS)
    with tempfile.TemporaryDirectory(prefix="kvtier-faults-") as workdir:
        return asyncio.run(cases(code, kinds, per_kind, Path(workdir)))
