"""The fleet's garbage collection: mark and sweep over the shared manifests, in epochs.

Reference counts are node-local (``kvstore.placement.refcount``), so no node deletes a chunk from
the shared bucket when its own count reaches zero (``ObjectTierConfig.shared``).
``collect`` does it for the whole fleet, one sweep at a time:

1. list the chunks and read every manifest; the candidates are the chunks no manifest
   names that are *collectable*: written more than ``grace_s`` ago (in-flight spills
   write chunks before their manifest) and first seen unnamed by a sweep more than
   ``retain_s`` ago (prefix reuse keeps unnamed chunks as cache);
2. publish them (``<e>/candidates``, then the epoch object ``marking``, by CAS) and wait
   ``mark_s``: longer than any spill that read the epoch before may take to commit;
3. CAS the epoch to ``deleting``, list the claims spills wrote, read every manifest
   again, write the list of what it deletes, delete the candidates neither named nor
   claimed, and CAS the epoch to ``done``.

The spill side, the objects and why every interleaving is safe: ``kvstore.fleet.epochs``
and docs/fleet.md. A sweep that finds another one in progress is ``Busy``; one in
progress for longer than ``lease_s`` (on S3's clock) is taken over where it stopped.
Each sweep that runs (not a dry run, not one refused ``Busy``) is reported to
``meta.observer`` (``kvstore.remote.observe``): ok with its deletions, or error (it
failed, or a corrupt manifest stopped it), and recorded in the bucket (``gc/last_run``:
result, deletions, sweeper), whose age every fleet node exports as the time of the last
sweep (``last_run``), so an alert needs nothing but the nodes' scrapes. ``progress`` is
told each step as it starts, in words (``kvtier fleet-gc`` prints them).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvstore.fleet.bucket import BucketIO
from kvstore.fleet.epochs import DEFAULT_SPILL_BOUND_S, Epoch, GcPaths, read_epoch
from kvstore.fleet.shared_meta import SharedMetaStore
from kvstore.format.errors import (
    Busy,
    ChunkCorrupt,
    InvalidRequest,
    KVTierError,
    StaleGeneration,
)
from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest
from kvstore.tiers.object_media import RAW, ZSTD

log = logging.getLogger(__name__)
KEEP_EPOCHS = 64  # deletion lists kept for nodes that have not spilled since
Progress = Callable[[str], None]
PROGRESS_EVERY_S = 15.0  # a line while the sweep waits out its mark time


def _quiet(step: str) -> None:
    """The default ``progress``: says nothing."""


@dataclass(frozen=True)
class GcTiming:
    grace_s: float = 3600.0  # a chunk written or re-written this recently is kept
    retain_s: float = 86400.0  # unnamed chunks stay this long as prefix cache
    spill_bound_s: float = DEFAULT_SPILL_BOUND_S  # published to the spills (fleet_epoch)
    # A manifest PUT's time in flight, botocore's retries included (ObjectTierConfig:
    # 3 attempts of 1 s connect + 10 s read, with backoff): added to the mark wait.
    request_margin_s: float = 45.0
    lease_s: float = 600.0  # a sweep's deleting phase at most; past it, one takes over

    def __post_init__(self) -> None:
        if min(self.grace_s, self.retain_s, self.request_margin_s) < 0 or \
                not 0 < self.spill_bound_s < self.lease_s:
            raise InvalidRequest("gc timing: grace_s, retain_s and request_margin_s must "
                                 "be >= 0 and 0 < spill_bound_s < lease_s")


GC_PRESETS = {
    "default": GcTiming(),
    "no-retention": GcTiming(retain_s=0.0),  # no prefix reuse across the fleet
}


@dataclass(frozen=True)
class FleetGcReport:
    epoch: int  # the epoch this sweep ran (0: none published)
    listed: int  # chunk objects listed
    live: int  # named by some manifest
    kept_young: int  # unnamed, written within grace_s
    kept_retained: int  # unnamed, seen unnamed for less than retain_s
    candidates: int  # collectable when the sweep marked them
    claimed: int  # candidates a spill claimed while the sweep marked
    named_again: int  # candidates a manifest named by the time the sweep deleted
    deleted: int
    bytes_freed: int
    manifests: int
    corrupt_manifests: int  # a corrupt manifest stops the sweep: its chunks are unknown
    dry_run: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sweeper_name() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


async def _named(meta: SharedMetaStore) -> tuple[set[str], int, int]:
    """(chunks some manifest names, manifests read, corrupt ones)."""
    named: set[str] = set()
    records = await meta.scan(MANIFEST_PREFIX)
    corrupt = 0
    for key, value in records:
        try:
            named.update(SessionManifest.decode(value).chunk_keys)
        except ChunkCorrupt as exc:
            corrupt += 1
            log.error("fleet gc: manifest %s is corrupt (%s): nothing is deleted", key, exc)
    return named, len(records), corrupt


async def _chunks(io: BucketIO, prefix: str, root: str) -> dict[str, tuple[list[str], int, float]]:
    """key -> (its object names, stored bytes, newest LastModified as epoch seconds)."""
    chunks: dict[str, tuple[list[str], int, float]] = {}
    for item in await io.listing(prefix):
        name: str = item["Key"]
        if name.startswith(root) or not name.endswith((RAW, ZSTD)):
            continue
        key = name[len(prefix):-len(RAW)]
        names, size, when = chunks.get(key, ([], 0, 0.0))
        chunks[key] = ([*names, name], size + item["Size"],
                       max(when, item["LastModified"].timestamp()))
    return chunks


async def collect(meta: SharedMetaStore, timing: GcTiming = GC_PRESETS["default"], *,
                  dry_run: bool = False, sweeper: str | None = None,
                  progress: Progress = _quiet) -> FleetGcReport:
    """One sweep of the bucket behind ``meta`` (safe beside serving nodes); ``dry_run``
    reports what would be marked and writes nothing."""
    sweeper = sweeper or sweeper_name()
    try:
        report = await _sweep(meta, timing, dry_run, sweeper, progress)
    except Busy:
        raise  # another sweep's turn: this one did not run
    except Exception:
        if not dry_run:
            meta.observer.gc_run("error", 0)
            await _record_run(meta, "error", 0, sweeper)
        raise
    if not dry_run:  # a corrupt manifest stopped it: nothing is collected until repaired
        result = "error" if report.corrupt_manifests else "ok"
        meta.observer.gc_run(result, report.deleted)
        await _record_run(meta, result, report.deleted, sweeper)
    progress(f"done: {report.deleted} chunks deleted in {report.seconds:.1f} s")
    return report


async def _record_run(meta: SharedMetaStore, result: str, deleted: int, sweeper: str) -> None:
    """``gc/last_run`` for the nodes' metrics; a bucket that refuses it loses only that."""
    try:
        await meta.io.put_json(meta.paths.last_run, {"result": result, "deleted": deleted,
                                                     "sweeper": sweeper, "unix": time.time()})
    except KVTierError as exc:
        log.warning("fleet gc: the run's record not written: %s", exc)


@dataclass(frozen=True)
class LastRun:
    result: str  # ok or error
    age_s: float  # since it was written, on S3's clock


async def last_run(meta: SharedMetaStore) -> LastRun | None:
    """The last sweep's record (None: no sweep has run on this bucket): one GET, one
    HEAD."""
    found = await meta.io.get_json(meta.paths.last_run)
    if found is None:
        return None
    age = await meta.io.age(meta.paths.last_run)
    result = found[1].get("result") if isinstance(found[1], dict) else None
    return LastRun("ok" if result == "ok" else "error", 0.0 if age is None else max(age, 0.0))


async def _sweep(meta: SharedMetaStore, timing: GcTiming, dry_run: bool,  # noqa: C901 - the sweep's phases share one progress report and its counters
                 sweeper: str, progress: Progress) -> FleetGcReport:
    started = time.monotonic()
    io, paths = meta.io, meta.paths
    prefix = meta.tier.s3_location()[2]
    current, etag = await read_epoch(io, paths)
    counts = dict(listed=0, live=0, kept_young=0, kept_retained=0, candidates=0, claimed=0,
                  named_again=0, deleted=0, bytes_freed=0, manifests=0, corrupt_manifests=0)

    def report(epoch: int) -> FleetGcReport:
        return FleetGcReport(epoch=epoch, dry_run=dry_run,
                             seconds=time.monotonic() - started, **counts)

    sizes: dict[str, tuple[list[str], int]] = {}
    if current.state != "done":  # another sweep's, or a dead one's to finish
        age = await io.age(paths.epoch)
        if dry_run or (age is not None and age < timing.lease_s + timing.request_margin_s):
            raise Busy(f"fleet gc: sweep {current.sweeper} is {current.state} epoch "
                       f"{current.epoch}; run again when it is done")
        log.warning("fleet gc: taking over epoch %d (%s) from %s, idle %.0f s",
                    current.epoch, current.state, current.sweeper, age or 0.0)
        found = await io.get_json(paths.candidates(current.epoch))
        candidates = list(found[1]) if found else []
        counts["candidates"] = len(candidates)
        if current.state == "marking":
            wait = max(0.0, current.mark_s - (age or 0.0))
            progress(f"taking over epoch {current.epoch} from {current.sweeper}: "
                     f"{len(candidates)} candidates, waiting {wait:.0f} s before deleting")
            await _mark_wait(wait, progress)
        epoch = current
    else:
        progress("listing the bucket's chunks")
        chunks = await _chunks(io, prefix, paths.root)
        progress(f"{len(chunks)} chunks listed; reading every manifest")
        named, counts["manifests"], counts["corrupt_manifests"] = await _named(meta)
        counts["listed"] = len(chunks)
        counts["live"] = sum(key in named for key in chunks)
        if counts["corrupt_manifests"]:
            return report(current.epoch)
        now = time.time()
        seen = await io.get_json(paths.unnamed)
        first_seen: dict[str, float] = {}
        candidates = []
        for key, (names, size, when) in chunks.items():
            if key in named:
                continue
            first_seen[key] = since = (seen[1].get(key, now) if seen else now)
            if when > now - timing.grace_s:
                counts["kept_young"] += 1
            elif since > now - timing.retain_s:
                counts["kept_retained"] += 1
            else:
                candidates.append(key)
                sizes[key] = (names, size)
        counts["candidates"] = len(candidates)
        if dry_run:
            return report(current.epoch)
        await io.put_json(paths.unnamed, first_seen)
        if not candidates:
            return report(current.epoch)
        e = current.epoch + 1
        await io.put_json(paths.candidates(e), sorted(candidates))
        mark_s = max(current.spill_bound_s, timing.spill_bound_s) + timing.request_margin_s
        epoch = Epoch(e, "marking", timing.spill_bound_s, mark_s, sweeper)
        etag = await _cas(io, paths, epoch, etag)
        progress(f"{counts['manifests']} manifests name {counts['live']} chunks; "
                 f"{len(candidates)} candidates marked in epoch {e}, waiting {mark_s:.0f} s "
                 "for spills in flight")
        await _mark_wait(mark_s, progress)
    return await _delete(meta, timing, epoch, etag, candidates, sizes, counts, sweeper, report,
                         progress)


async def _mark_wait(seconds: float, progress: Progress) -> None:
    """Sleep ``seconds``, telling ``progress`` what is left every ``PROGRESS_EVERY_S``."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(left, PROGRESS_EVERY_S))
        if deadline - time.monotonic() > 0:
            progress(f"waiting for spills in flight: {deadline - time.monotonic():.0f} s left")


async def prepare_bucket(meta: SharedMetaStore, spill_bound_s: float = DEFAULT_SPILL_BOUND_S
                         ) -> bool:
    """Create the epoch object (epoch 0, done, this spill bound) if the bucket has none;
    whether it did. For a bucket no node serves yet: a node that read no epoch object
    assumes ``DEFAULT_SPILL_BOUND_S``, so a smaller bound is safe only before any spill
    (a sweep always waits the bound the epoch object last published)."""
    try:
        await meta.io.put_json(meta.paths.epoch, Epoch(spill_bound_s=spill_bound_s).to_dict(),
                               if_absent=True)
    except StaleGeneration:
        return False
    return True


async def _cas(io: BucketIO, paths: GcPaths, epoch: Epoch, etag: str | None) -> str:
    try:
        return await io.put_json(paths.epoch, epoch.to_dict(), if_match=etag,
                                 if_absent=etag is None)
    except StaleGeneration as exc:
        raise Busy(f"fleet gc: another sweep moved the epoch first (to {epoch.state} "
                   f"{epoch.epoch} here): run again when it is done") from exc


async def _delete(meta: SharedMetaStore, timing: GcTiming, epoch: Epoch, etag: str | None,
                  candidates: list[str], sizes: dict[str, tuple[list[str], int]],
                  counts: dict[str, int], sweeper: str, report, progress: Progress
                  ) -> FleetGcReport:
    """Phase 2: deleting, claims, manifests again, the deletion list, deletes, done."""
    io, paths, e = meta.io, meta.paths, epoch.epoch
    sent = time.monotonic()
    etag = await _cas(io, paths, Epoch(e, "deleting", epoch.spill_bound_s, epoch.mark_s,
                                       sweeper), etag)
    deadline = sent + timing.lease_s  # a sweep taking over waits past it (S3's clock)
    prefix = paths.claims(e)
    claims = {item["Key"][len(prefix):] for item in await io.listing(prefix)}
    named, counts["manifests"], counts["corrupt_manifests"] = await _named(meta)
    doomed: list[str] = []
    if not counts["corrupt_manifests"]:
        for key in candidates:
            if key in claims:
                counts["claimed"] += 1
            elif key in named:
                counts["named_again"] += 1
            else:
                doomed.append(key)
    await io.put_json(paths.deleted(e) + sweeper, doomed)  # before any delete
    progress(f"deleting {len(doomed)} chunks ({counts['claimed']} claimed by spills, "
             f"{counts['named_again']} named again: kept)")
    names = {key: sizes.get(key, ([key + RAW, key + ZSTD], 0)) for key in doomed}
    gone = set(await io.delete_many((n for key in doomed for n in names[key][0]),
                                    before=lambda: time.monotonic() < deadline))
    for key in doomed:
        if all(n in gone for n in names[key][0]):
            counts["deleted"] += 1
            counts["bytes_freed"] += names[key][1]
    if counts["deleted"] < len(doomed):
        log.warning("fleet gc: %d of %d chunks not deleted (lease over or refused): the "
                    "next sweep takes them", len(doomed) - counts["deleted"], len(doomed))
    try:
        await io.put_json(paths.epoch, Epoch(e, "done", epoch.spill_bound_s, 0.0,
                                             sweeper).to_dict(), if_match=etag)
    except StaleGeneration:
        log.warning("fleet gc: another sweep finished epoch %d first", e)
        return report(e)
    await _clean(io, paths, e)
    return report(e)


async def _clean(io: BucketIO, paths: GcPaths, e: int) -> None:
    """Drop the candidates and claims of done epochs, and deletion lists older than
    ``KEEP_EPOCHS`` (a node further behind compares a listing instead)."""
    old: list[str] = []
    for item in await io.listing(paths.gc):
        part = item["Key"][len(paths.gc):].split("/", 1)
        if len(part) < 2 or not part[0].isdigit():
            continue
        epoch = int(part[0])
        if epoch > e:
            continue
        if not part[1].startswith("deleted/") or epoch <= e - KEEP_EPOCHS:
            old.append(item["Key"])
    await io.delete_many(old)
