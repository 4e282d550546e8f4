"""Power-loss campaign: run a workload on a recorded disk tier, crash it at every point.

    from testing.power_loss import run_crash_campaign, small_workload
    report = run_crash_campaign(small_workload(), seed=0)   # a dict, see CampaignReport

A workload is a list of steps (durable spills, deletes, a compaction) run through a
``TierManager`` over one ``DiskTier`` whose file system is a ``RecordingFileSystem``
(``simfs.py``). Every step notes where in the I/O log it began and where it was
acknowledged. Then, for every prefix of the log and every crash variant, the image a
power cut would leave is reopened (a fresh ``DiskTier`` and ``TierManager``) and
checked:

- every session acknowledged durable restores bit-exact (chunks and tail) as its
  acknowledged generation, or as the generation of a spill in flight at the crash;
- a session whose delete was acknowledged stays deleted;
- nothing restores wrong: bytes that are not exactly those of an allowed generation;
- a session never acknowledged may be missing (``SessionNotFound`` or ``DataLoss``);
- recovery never raises, and the reopened tier takes and returns a new durable spill.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvstore.format.errors import DataLoss, SessionNotFound
from kvstore.tiers.disk.index import SegState
from kvstore.tiers.disk.tier import DiskTier
from testing.simfs import RecordingFileSystem, power_loss_images

TENANT = "crash"
SEGMENT_BYTES = 4096  # small, so the workload seals segments and compaction has work
CAPACITY = 1 << 26


@dataclass(frozen=True)
class Spill:
    session: str
    generation: int
    tokens: int  # session length; chunk bytes follow from (session, generation)


@dataclass(frozen=True)
class Delete:
    session: str


@dataclass(frozen=True)
class Compact:
    """Rewrite every SEALED segment holding live records (``rewrite_segments``)."""


Step = Spill | Delete | Compact


def small_workload() -> list[Step]:
    """A few durable spills, a replaced generation, deletes and one compaction."""
    return [Spill("a", 1, 40), Spill("b", 1, 24), Spill("c", 1, 64), Spill("a", 2, 56),
            Delete("b"), Compact(), Spill("d", 1, 30), Delete("a")]


def large_workload(sessions: int = 6, rounds: int = 3, seed: int = 0) -> list[Step]:
    rng = random.Random(seed)
    steps: list[Step] = []
    generations = dict.fromkeys(range(sessions), 0)
    for round_ in range(rounds):
        for s in rng.sample(range(sessions), sessions):
            generations[s] += 1
            steps.append(Spill(f"s{s}", generations[s], rng.randrange(8, 90)))
        steps += [Delete(f"s{s}") for s in rng.sample(range(sessions), 2)]
        if round_ % 2 == 0:
            steps.append(Compact())
    return steps


@dataclass
class CampaignReport:
    events: int = 0  # file-system events the workload logged
    crash_points: int = 0  # prefixes of the log tried
    images: int = 0  # distinct crash states reopened and checked
    acked_durable: int = 0  # (image, session) pairs where a durable ack was owed
    acked_lost: int = 0  # of those, restores that did not give an allowed state
    wrong: int = 0  # restores that returned bytes of no allowed generation
    recovery_failures: int = 0  # reopen, restore or a new spill raised unexpectedly
    failures: list[str] = field(default_factory=list)  # the first few, described

    def as_dict(self) -> dict:
        return asdict(self)


def crash_layout():
    from kvstore.format.layout import LayoutSpec, Stream
    from kvstore.format.registry import register_layout

    return register_layout(LayoutSpec(
        name="power-loss-tiny",
        streams=(Stream("lat", (32,), bits=4, group_size=32, tokens_per_entry=4, layers=2),),
        chunk_tokens=16,
    ))


def session_args(spec, step: Spill) -> dict:
    """spill() arguments of a session generation: chunks are a pure function of it."""
    import torch

    from kvstore.format.chunk import StreamData, encode_chunk
    from kvstore.format.keys import block_keys, dedupe_scope

    rng = np.random.default_rng([ord(c) for c in step.session] + [step.generation])
    tokens = rng.integers(0, 50_000, step.tokens, dtype=np.uint32)
    gen = torch.Generator().manual_seed(step.generation * 7919 + len(step.session))

    def encode(start: int, part: np.ndarray) -> bytes:
        stream = spec.persistent_streams[0]
        entries = stream.entries_for(len(part))
        codes = torch.randint(0, 256, (stream.layers, entries, *stream.codes_shape),
                              dtype=torch.uint8, generator=gen)
        scales = torch.rand((stream.layers, entries, stream.scales_per_entry), generator=gen)
        return encode_chunk(spec, start, part,
                            {stream.name: StreamData(codes, scales.to(torch.float16))})

    size = spec.chunk_tokens
    parts = [encode(start, tokens[start:start + size])
             for start in range(0, len(tokens) - size + 1, size)]
    keys = block_keys(spec.layout_id, tokens, size, parts, scope=dedupe_scope(TENANT))
    chunks = list(zip(keys, parts, strict=True))
    covered = len(keys) * size
    tail = encode(covered, tokens[covered:]) if covered < len(tokens) else b""
    return dict(layout_id=spec.layout_id, token_ids=tokens, chunks=chunks, tail=tail)


def restores_exactly(result, args: dict) -> bool:
    """Whether a ``RestoreResult`` holds exactly the chunks and tail of ``args``."""
    return ([bytes(c) for c in result.chunks] == [bytes(c) for _, c in args["chunks"]]
            and bytes(result.manifest.tail) == bytes(args["tail"]))


async def _open(path: Path, fs=None):
    from kvstore.session.manager import TierManager

    kwargs = {"fs": fs} if fs is not None else {}
    disk = DiskTier(path, CAPACITY, segment_bytes=SEGMENT_BYTES, **kwargs)
    try:
        return disk, await TierManager.open([disk], disk.meta)
    except BaseException:
        await disk.close()
        raise


async def _record(steps: Sequence[Step], spec, root: Path) -> tuple[list, list, dict]:
    """Run the workload; returns (log, [(step, start, end)], {(session, gen): args})."""
    fs = RecordingFileSystem(root / "tier", root / "snapshots")
    (root / "tier").mkdir()
    disk, manager = await _open(root / "tier", fs)
    timeline, written = [], {}
    try:
        for step in steps:
            start = len(fs.log)
            if isinstance(step, Spill):
                args = session_args(spec, step)
                written[(step.session, step.generation)] = args
                await manager.spill(TENANT, step.session, generation=step.generation,
                                    ack="durable", **args)
            elif isinstance(step, Delete):
                await manager.delete(TENANT, step.session)
            else:
                sealed = [s.seg_id for s in disk.segments()
                          if s.state == SegState.SEALED and s.live_records]
                if sealed:
                    await disk.rewrite_segments(sealed)
            timeline.append((step, start, len(fs.log)))
    finally:
        await manager.close()
    return fs.log, timeline, written


def _allowed(timeline, session: str, point: int) -> tuple[set, bool]:
    """(states a restore may show at ``point``: generation numbers, None = absent;
    whether a durable ack of the session's current state was owed)."""
    state, owed = None, False
    in_flight = set()
    for step, start, end in timeline:
        if getattr(step, "session", None) != session or start >= point:
            continue
        new = step.generation if isinstance(step, Spill) else None
        if end <= point:
            state, owed = new, True
        else:
            in_flight.add(new)
    return {state} | in_flight, owed


async def _check(image: Path, timeline, written, point: int, report: CampaignReport,
                 spec) -> None:
    where = f"point {point}, {image}"
    try:
        disk, manager = await _open(image)
    except Exception as exc:  # noqa: BLE001 - any failure to recover is what we count
        report.recovery_failures += 1
        report.failures.append(f"{where}: reopen raised {exc!r}")
        return
    try:
        for session in sorted({s for s, _ in written}):
            allowed, owed = _allowed(timeline, session, point)
            if owed and allowed != {None}:
                report.acked_durable += 1
            try:
                got = await manager.restore(TENANT, session)
            except SessionNotFound:
                if None not in allowed:
                    report.acked_lost += 1
                    report.failures.append(f"{where}: {session} lost (allowed {allowed})")
                continue
            except DataLoss as exc:
                if owed:
                    report.acked_lost += 1
                    report.failures.append(f"{where}: {session} DataLoss {exc}")
                continue
            generation = got.manifest.generation
            expected = written.get((session, generation))
            exact = expected is not None and restores_exactly(got, expected)
            if not exact or generation not in allowed:
                report.wrong += 1
                report.failures.append(f"{where}: {session} restored generation "
                                       f"{generation} (allowed {allowed}, exact={exact})")
        probe = session_args(spec, Spill("after-crash", 1, 20))
        await manager.spill(TENANT, "after-crash", generation=1, ack="durable", **probe)
        if not restores_exactly(await manager.restore(TENANT, "after-crash"), probe):
            raise AssertionError("a spill after recovery did not read back")
    except Exception as exc:  # noqa: BLE001
        report.recovery_failures += 1
        report.failures.append(f"{where}: {exc!r}")
    finally:
        await manager.close()


async def campaign(steps: Sequence[Step], seed: int, workdir: Path) -> CampaignReport:
    spec = crash_layout()
    log, timeline, written = await _record(steps, spec, workdir)
    report = CampaignReport(events=len(log), crash_points=len(log) + 1)
    for image in power_loss_images(log, workdir / "crash", seed):
        report.images += 1
        await _check(image.path, timeline, written, image.point, report, spec)
    del report.failures[20:]
    return report


def run_crash_campaign(workload: Sequence[Step] | None = None, seed: int = 0) -> dict:
    """Run ``workload`` (default ``small_workload()``) and check every crash state; the
    counts as a dict (``CampaignReport`` fields). Runs its own event loop."""
    with tempfile.TemporaryDirectory(prefix="kvtier-power-loss-") as workdir:
        report = asyncio.run(campaign(workload or small_workload(), seed, Path(workdir)))
    return report.as_dict()
