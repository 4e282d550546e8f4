"""The disk tier: append-only segment files indexed in LMDB, all file I/O through ``fs``.

Write path: append the record to the active segment, queue its index entry, then group
commit (``pipeline.py``): fsync every segment the batch wrote, then one LMDB transaction.
The index never names bytes that were not fsynced; until its commit a put is visible to
this process through an in-memory overlay.

Acknowledgement: ``durable=True`` (per put or the tier default) returns after the batch
committed; buffered (``durable=False``) returns after the append and commits within
``commit_interval_s``, ``flush()`` being the barrier. A session's durable ack is
``put_many(chunks, meta={manifest})`` (one transaction) or buffered puts followed by
``commit_with_meta({manifest})``, which commits in order after them.

Two processes on one directory: the writer (``writer=True``, the server) holds
``writer.lock`` for its life and alone appends and recovers (a second writer gets
``Busy``); an attached tier (``writer=False``, the offline compactor) reads, deletes,
commits meta and compacts. Every accounting figure lives in the index, so both see the
same numbers. Compaction holds ``compact.lock`` (``rewrite.py`` has its protocol).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import ClassVar

from kvstore.format.errors import (
    ChunkCorrupt,
    ChunkNotFound,
    InvalidRequest,
    KVTierError,
    TierFull,
    TierUnavailable,
)
from kvstore.tiers.base import Buffer, Tier
from kvstore.tiers.disk import admission, batch, metalog
from kvstore.tiers.disk.fs import OS, FileSystem
from kvstore.tiers.disk.headroom import (
    DEFAULT_RESERVE_BYTES,
    check_room,
    index_growth,
    medium_full,
)
from kvstore.tiers.disk.index import (
    DeleteOp,
    DiskIndex,
    EndOp,
    IndexEntry,
    MetaOp,
    PutOp,
    SegmentInfo,
    SegState,
)
from kvstore.tiers.disk.index_check import check_names_segments
from kvstore.tiers.disk.lock import COMPACT_LOCK, WRITER_LOCK, DirLock
from kvstore.tiers.disk.log import SegmentAppender, storage_error
from kvstore.tiers.disk.meta import DiskMetaStore, encode_writes
from kvstore.tiers.disk.metalog import SequenceClock
from kvstore.tiers.disk.pipeline import CommitPipeline
from kvstore.tiers.disk.reader import SegmentFiles, SegmentGone
from kvstore.tiers.disk.reclaim import Reclaimer
from kvstore.tiers.disk.recovery import RecoveryReport, recover
from kvstore.tiers.disk.rewrite import Rewriter, RewriteResult
from kvstore.tiers.disk.segments import check_record, key_bytes, record_size

log = logging.getLogger(__name__)

MiB = 1 << 20


class DiskTier(Tier):
    name: ClassVar[str] = "disk"
    durable = True

    def __init__(self, path: str | Path, capacity_bytes: int, *, segment_bytes: int = 64 * MiB,
                 durable: bool = True, writer: bool = True, map_size: int = 64 << 30,
                 commit_interval_s: float = 0.002, max_pending_bytes: int = 256 * MiB,
                 clock: Callable[[], float] = time.time, fs: FileSystem = OS,
                 reclaim_dead_fraction: float = 1.0, reclaim_interval_s: float = 5.0,
                 reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> None:
        """``fs``: the seam every segment-file call goes through (``fs.py``);
        ``reclaim_dead_fraction`` (below 1: on): the writer rewrites sealed segments at
        least that dead itself, at most once per ``reclaim_interval_s`` (``reclaim.py``);
        ``reserve_bytes``: free space on the medium that puts leave (``headroom.py``)."""
        super().__init__(capacity_bytes)
        self.clock = clock  # wall-clock seconds that TTLs are set and judged by
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be > 0, got {segment_bytes}")
        self.path = Path(path)
        self.reserve_bytes = reserve_bytes
        self.segment_dir = self.path / "segments"
        self.fs = fs
        fs.mkdir(self.segment_dir)
        self.segment_bytes = segment_bytes
        self.durable_writes = durable  # default acknowledgement mode of put and delete
        self.writer_lock = DirLock(self.path / WRITER_LOCK, "the disk tier's writer lock")
        self.compact_lock = DirLock(self.path / COMPACT_LOCK, "the compaction lock")
        self.recovery: RecoveryReport | None = None
        if writer:
            self.writer_lock.acquire()
        try:
            self.index = DiskIndex(self.path / "index", map_size=map_size, fs=fs,
                                   check=writer, report_as=self.path)
            if writer:
                check_names_segments(self.index.next_segment(), fs, self.segment_dir,
                                     self.path)
                self.recovery = recover(self.index, self.segment_dir, self.compact_lock)
        except BaseException:
            if hasattr(self, "index"):
                self.index.close()
            self.writer_lock.release()
            raise
        self.files = SegmentFiles(self.segment_dir, fs=fs)
        self.pipeline = CommitPipeline(self.index, self.segment_dir,
                                       commit_interval_s=commit_interval_s,
                                       max_pending_bytes=max_pending_bytes)
        self._appender = (SegmentAppender(self.index, self.segment_dir, segment_bytes,
                                          SegState.ACTIVE, self.pipeline.failed_syncs)
                          if writer else None)
        self._resume = self.recovery.active if self.recovery else None
        self._append_lock = asyncio.Lock()
        self._epoch = self.index.segment_epoch()
        self._lsn = SequenceClock(self.index.meta_lsn())
        self.rewriter = Rewriter(self.path, self.index, self.files, segment_bytes,
                                 self.compact_lock, reserve_bytes)
        self.reclaimer = Reclaimer(self.rewriter, self.segments,
                                   reclaim_dead_fraction if writer else 1.0,
                                   reclaim_interval_s, 2 * commit_interval_s)
        self._closed = False

    @classmethod
    def writer_is_live(cls, path: str | Path) -> bool:
        lock = Path(path) / WRITER_LOCK
        return lock.exists() and DirLock(lock, "").is_held_elsewhere()

    @property
    def meta(self) -> DiskMetaStore:
        """The MetaStore this tier keeps (``meta.py``)."""
        return DiskMetaStore(self.index, self.commit_with_meta, self._read_logged)

    async def _read_logged(self, kb: bytes, entry: IndexEntry) -> bytes:
        self.files.pin(entry.seg_id)
        try:
            return metalog.logged_value(await self._read(kb, entry, metalog.META))
        finally:
            self.files.unpin(entry.seg_id)

    @property
    def used_bytes(self) -> int:
        """Sum of live value lengths: committed (any process) plus this one's pending."""
        return self.pipeline.committed_totals()[0] + self.pipeline.pending_delta

    def medium_full(self) -> bool:
        return medium_full(self.path, self.reserve_bytes)

    @property
    def live_bytes(self) -> int:
        """Same as ``used_bytes``; with ``dead_bytes`` and ``file_bytes`` for compaction.
        Entries past their TTL count until purged (a get or ``purge_expired``)."""
        return self.used_bytes

    def segments(self) -> list[SegmentInfo]:
        """Every segment with its exact live, dead and file bytes (committed state)."""
        infos = self.index.all_segments()
        self.files.forget_except({info.seg_id for info in infos})
        return infos

    @property
    def file_bytes(self) -> int:
        return sum(info.file_bytes for info in self.index.all_segments())

    @property
    def dead_bytes(self) -> int:
        return sum(info.dead_bytes for info in self.index.all_segments())

    async def count(self) -> int:
        """Entries held, counting expired ones not yet purged (as ``used_bytes`` does)."""
        return self.pipeline.committed_totals()[1] + self.pipeline.pending_items

    # Tier API

    async def put(self, key: str, value: Buffer, *, ttl_s: float | None = None,
                  durable: bool | None = None) -> None:
        ((kb, view, header, checksum),) = await admission.prepared([(key, value)])
        expires = _expiry(ttl_s, self.clock())
        async with self._append_lock:
            self._check_writable()
            old = self._length_or_none(kb)
            delta = view.nbytes - (old or 0)
            if self.used_bytes + delta > self.capacity_bytes:
                raise TierFull(f"disk tier: {view.nbytes} bytes for {key!r} do "
                               f"not fit ({self.used_bytes} of {self.capacity_bytes} used)")
            check_room(self.path, record_size(len(kb), view.nbytes) + index_growth(1),
                       self.reserve_bytes)
            try:
                entry = await self._append(kb, [header, kb, view], view.nbytes, checksum,
                                           expires)
            finally:
                for args in self._seals():  # after the puts in the sealed segment
                    self.pipeline.enqueue(*args)
            op = self.pipeline.enqueue(PutOp(kb, entry), kb, delta, int(old is None),
                                       view.nbytes, future=self._wants_ack(durable))
        await self.pipeline.settle(op)
        if old is not None:
            self.reclaimer.poke()

    async def put_many(self, items: Iterable[tuple[str, Buffer]], *,
                       meta: dict[str, bytes | None] | None = None,
                       ttl_s: float | None = None, durable: bool | None = None) -> None:
        """Put every item and apply ``meta`` in one index transaction: all or none."""
        prepared = await admission.prepared(items)
        expires = _expiry(ttl_s, self.clock())
        async with self._append_lock:
            self._check_writable()
            lengths: dict[bytes, int | None] = {}
            plans = []  # (delta, items) of each put against the state before it
            for kb, view, _, _ in prepared:
                old = lengths[kb] if kb in lengths else self._length_or_none(kb)
                plans.append((view.nbytes - (old or 0), 0 if old is not None else 1))
                lengths[kb] = view.nbytes
            growth = sum(delta for delta, _ in plans)
            if self.used_bytes + growth > self.capacity_bytes:
                raise TierFull(f"disk tier: a batch of {len(prepared)} values "
                               f"needs {growth} more bytes ({self.used_bytes} of "
                               f"{self.capacity_bytes} used)")
            encoded = encode_writes(meta or {})
            records = sum(record_size(len(kb), view.nbytes) for kb, view, _, _ in prepared)
            check_room(self.path, records + index_growth(len(prepared))
                       + metalog.room_needed(encoded), self.reserve_bytes)
            ready: list[tuple] = []  # enqueue arguments, queued once all are appended
            try:
                for (kb, view, header, checksum), (delta, count) in zip(prepared, plans,
                                                                        strict=True):
                    entry = await self._append(kb, [header, kb, view], view.nbytes,
                                               checksum, expires)
                    ready += self._seals()
                    ready.append((PutOp(kb, entry), kb, delta, count, view.nbytes))
            except BaseException:
                for args in ready + self._seals():  # seals stand; none of the puts lands
                    if isinstance(args[0], EndOp):
                        self.pipeline.enqueue(*args)
                raise
            if meta:
                ready += await self._logged_meta(encoded, checked=True)
            if not ready:
                return
            ops = [self.pipeline.enqueue(*args) for args in ready[:-1]]
            ops.append(self.pipeline.enqueue(*ready[-1], future=self._wants_ack(durable)))
        await self.pipeline.settle(ops[-1])

    async def commit_with_meta(self, writes: dict[str, bytes | None]) -> None:
        """Durably apply metadata writes, in order after every put accepted before this
        call: the same transaction as still-pending ones, or a later one."""
        async with self._append_lock:
            self._check_open()
            ready = await self._logged_meta(encode_writes(writes))
            for args in ready[:-1]:
                self.pipeline.enqueue(*args)
            queued = self.pipeline.enqueue(*ready[-1], future=True)
        await self.pipeline.settle(queued)
        if any(value is None for value in writes.values()):
            self.reclaimer.poke()

    async def _logged_meta(self, encoded: dict[bytes, bytes | None], *,
                           checked: bool = False) -> list[tuple]:
        """Enqueue arguments applying ``encoded`` (``encode_writes``) with the segment
        records that log them (``metalog.py``), the MetaOp last; an attached tier logs
        them in a segment of its own. ``checked``: the caller already checked the room.
        Call holding the append lock."""
        if not checked:
            check_room(self.path, metalog.room_needed(encoded), self.reserve_bytes)
        lsn = self._lsn.next()
        logged = list(metalog.records(encoded, lsn))
        if self._appender is None and logged:
            aside = SegmentAppender(self.index, self.segment_dir, self.segment_bytes,
                                    SegState.BUILDING)
            return await metalog.logged_aside(aside, encoded, logged, lsn)
        entries: dict[bytes, IndexEntry] = {}
        ready: list[tuple] = []
        try:
            for key, parts, value_len, checksum in logged:
                entries[key] = await self._append(key, parts, value_len, checksum, 0)
                ready += self._seals()
        except BaseException:
            for args in ready + self._seals():
                self.pipeline.enqueue(*args)
            raise
        return [*ready, (MetaOp(encoded, entries, lsn),)]

    async def get(self, key: str) -> Buffer:
        """The value as a read-only view, after verifying its record checksum."""
        kb = key_bytes(key)
        self._check_open()
        for _ in range(3):
            # Epoch before lookup: an index switch committed between the two would
            # otherwise leave the old segment open, with no later epoch change to close it.
            self._forget_retired()
            entry = self._current(kb)
            if entry is None:
                raise ChunkNotFound(f"disk tier holds no {key!r}")
            if entry.expired(self.clock()):
                await self._purge_if_expired(kb)
                raise ChunkNotFound(f"disk tier: {key!r} expired")
            self.files.pin(entry.seg_id)
            try:
                return await self._read(kb, entry)
            except SegmentGone:
                continue  # retired by a compaction after the lookup: look it up again
            finally:
                self.files.unpin(entry.seg_id)
        raise TierUnavailable(f"disk tier: segments of {key!r} keep vanishing")

    async def get_many(self, keys: Sequence[str]) -> list[Buffer | KVTierError]:
        """``get`` of each key, read in file order in one batch (``batch.py``)."""
        return (await self.get_many_proven(keys))[0]

    async def get_many_proven(self, keys: Sequence[str]
                              ) -> tuple[list[Buffer | KVTierError], list[bool]]:
        """``get_many``, and per key whether its bytes have the digest its key states."""
        self._check_open()
        self._forget_retired()
        now = self.clock()

        def current(kbs: Sequence[bytes]) -> list[IndexEntry | None]:
            overlay = self.pipeline.overlay
            found = self.index.lookup_many([kb for kb in kbs if kb not in overlay])[::-1]
            entries = [overlay[kb][1] if kb in overlay else found.pop() for kb in kbs]
            return [None if e is None or e.expired(now) else e for e in entries]

        return await batch.get_many(self.files, keys, current, self.get, self.path)

    async def _read(self, kb: bytes, entry: IndexEntry, flags: int = 0) -> memoryview:
        size = record_size(len(kb), entry.value_len)
        # Messages may reach a client: the segment's path and offset go to the log only.
        location = f"disk tier {self.path}, segment {entry.seg_id} @ {entry.offset}"

        def check(record: memoryview) -> memoryview:
            return check_record(record, kb, entry.value_len, entry.checksum,
                                f"disk tier, key {kb!r}", flags).toreadonly()

        try:
            return await self.files.read(entry.seg_id, entry.offset, size, check)
        except OSError as exc:
            log.warning("%s: read failed: %s", location, exc)
            raise TierUnavailable(f"disk tier: reading a segment failed: "
                                  f"{exc.strerror or type(exc).__name__}") from exc
        except ChunkCorrupt as exc:
            log.warning("%s: %s", location, exc)
            raise

    async def delete(self, key: str, *, durable: bool | None = None) -> int:
        kb = key_bytes(key)
        async with self._append_lock:
            self._check_open()
            old = self._length_or_none(kb)
            if old is None:
                return 0
            op = self.pipeline.enqueue(DeleteOp(kb), kb, -old, -1, 0,
                                       future=self._wants_ack(durable))
        try:
            await self.pipeline.settle(op)
        finally:  # a caller cancelled while it waits still had its delete queued
            self.reclaimer.poke()
        return old

    async def contains(self, key: str) -> bool:
        self._check_open()
        entry = self._current(key_bytes(key))
        return entry is not None and not entry.expired(self.clock())

    async def ttl_s(self, key: str) -> float | None:
        entry = self._current(key_bytes(key))
        if entry is None or entry.expired(self.clock()):
            raise ChunkNotFound(f"disk tier holds no {key!r}")
        return max(0.001, entry.expires_ms / 1000 - self.clock()) if entry.expires_ms else None

    async def keys(self) -> AsyncIterator[str]:
        overlay = dict(self.pipeline.overlay)
        start = None
        while batch := self.index.entries_after(start, 1024):
            now = self.clock()
            for kb, entry in batch:
                if kb not in overlay and not entry.expired(now):
                    yield kb.decode()
            start = batch[-1][0]
            await asyncio.sleep(0)
        now = self.clock()
        for kb, (_, pending) in overlay.items():
            if pending is not None and not pending.expired(now):
                yield kb.decode()

    async def purge_expired(self) -> int:
        """Delete every entry past its TTL; returns how many."""
        expired, start, now = [], None, self.clock()
        while batch := self.index.entries_after(start, 4096):
            expired += [kb for kb, entry in batch if entry.expired(now)]
            start = batch[-1][0]
        purged = [await self._purge_if_expired(kb) for kb in expired]
        await self.flush()
        return sum(purged)

    async def flush(self) -> None:
        """Commit everything accepted so far. Raises the error that lost any buffered
        write since the previous flush (those writes are not stored)."""
        await self.pipeline.flush()

    async def close(self) -> None:
        if self._closed:
            return
        try:
            await self.flush()
        except (TierFull, TierUnavailable) as exc:
            log.error("disk tier %s: closing with lost buffered writes: %s", self.path, exc)
        finally:
            async with self._append_lock:  # an append in flight queues its entry first
                self._closed = True
            self.reclaimer.cancel()
            await self.pipeline.close()  # LMDB must not close under a commit's thread
            if self._appender is not None:
                await self._appender.close()
            self.files.close()
            self.index.close()
            self.writer_lock.release()
            self.compact_lock.release()

    # compaction primitives (``rewrite.py`` has the protocol)

    def live_entries(self, seg_id: int) -> list[tuple[str, IndexEntry]]:
        """The entries naming ``seg_id``, in offset order."""
        return [(kb.decode(), e) for kb, e in self.index.live_entries({seg_id})[seg_id]]

    async def read_entry(self, key: str, entry: IndexEntry) -> memoryview:
        """The verified value an entry names (``ChunkCorrupt`` when it fails)."""
        kb = key_bytes(key)
        self.files.pin(entry.seg_id)
        try:
            return await self._read(kb, entry)
        finally:
            self.files.unpin(entry.seg_id)

    async def rewrite_segments(self, seg_ids: Iterable[int]) -> RewriteResult:
        """``Rewriter.rewrite`` (``rewrite.py``)."""
        return await self.rewriter.rewrite(list(seg_ids))

    async def retire_segment(self, seg_id: int) -> bool:
        return await self.rewriter.retire(seg_id)

    async def sweep(self) -> tuple[list[int], list[int]]:
        return await self.rewriter.sweep()

    # internals

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("disk tier is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._appender is None:
            raise TierUnavailable(f"disk tier {self.path} is attached beside a live writer "
                                  "(writer=False): it does not append")

    def _forget_retired(self) -> None:
        """Close handles of segments another process retired, so their space is freed."""
        epoch = self.index.segment_epoch()
        if epoch != self._epoch:
            self._epoch = epoch
            self.segments()

    def _wants_ack(self, durable: bool | None) -> bool:
        return self.durable_writes if durable is None else durable

    def _current(self, kb: bytes) -> IndexEntry | None:
        pending = self.pipeline.overlay.get(kb)
        return pending[1] if pending is not None else self.index.lookup(kb)

    def _length_or_none(self, kb: bytes) -> int | None:
        entry = self._current(kb)
        return None if entry is None else entry.value_len

    async def _append(self, kb: bytes, parts: list[Buffer], value_len: int, checksum: int,
                      expires: int) -> IndexEntry:
        assert self._appender is not None  # a writer's (_check_writable)
        if self._resume is not None:
            try:
                await self._appender.resume(*self._resume)
            except OSError as exc:
                raise storage_error(exc, f"disk tier: segment {self._resume[0]}") from exc
            self._resume = None
        size = record_size(len(kb), value_len)
        seg_id, offset = await self._appender.append(parts, size)
        return IndexEntry(seg_id, offset, value_len, checksum, expires)

    def _seals(self) -> list[tuple[EndOp]]:
        """Queue arguments marking the segments the appender sealed as SEALED."""
        assert self._appender is not None  # a writer's (_check_writable)
        return [(EndOp(seg_id, end, True),) for seg_id, end in self._appender.take_sealed()]

    async def _purge_if_expired(self, kb: bytes) -> bool:
        async with self._append_lock:
            entry = self._current(kb)
            if entry is None or not entry.expired(self.clock()) or self._closed:
                return False
            op = self.pipeline.enqueue(DeleteOp(kb), kb, -entry.value_len, -1, 0)
        await self.pipeline.settle(op)
        return True


def _expiry(ttl_s: float | None, now: float) -> int:
    if ttl_s is None:
        return 0
    if not ttl_s > 0:
        raise InvalidRequest(f"ttl_s must be > 0, got {ttl_s}")
    return int((now + ttl_s) * 1000)
