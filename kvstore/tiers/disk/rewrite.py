"""Compaction primitives of the disk tier: rewrite live records, switch, retire.

Protocol (crash-safe at every step, and safe beside a live writer):

1. Take ``compact.lock`` (``Busy`` if another compaction runs) and sweep: remove the
   BUILDING segments a killed compaction left and files whose removal a crash cut short.
2. Rewrite only SEALED segments (the writer never touches them again): copy each live
   record, verified, into new BUILDING segments (named in the index, by no entry), fsync.
3. One LMDB transaction: switch each moved entry by compare-and-swap (a put or delete
   the writer committed meanwhile wins; its copy is dead bytes), mark the new segments
   SEALED, and forget every source segment no entry names any more.
4. Only then remove the forgotten files: at once when no reader here pins them, else at
   the last unpin. A reader in another process keeps an open descriptor, or finds the
   file gone and looks the key up again.

A crash before 3 leaves BUILDING segments and the old entries; after 3, unnamed files;
the next sweep or writer open removes either. A record failing its checksum is not
copied: its entry keeps its segment alive, and its key is reported (the scrub
quarantines it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.format.errors import ChunkCorrupt, ChunkTruncated, InvalidRequest
from kvstore.tiers.disk.headroom import check_room, rewrite_need
from kvstore.tiers.disk.index import DiskIndex, IndexEntry, SegState
from kvstore.tiers.disk.lock import DirLock
from kvstore.tiers.disk.log import SegmentAppender, storage_error
from kvstore.tiers.disk.reader import SegmentFiles
from kvstore.tiers.disk.recovery import drop_abandoned_builds, remove_unnamed_files
from kvstore.tiers.disk.segments import check_record, record_size


@dataclass
class RewriteResult:
    sources: list[int]
    source_bytes: int = 0  # file bytes of the source segments
    new_segments: list[int] = field(default_factory=list)
    written_bytes: int = 0  # file bytes of the new segments
    moved: int = 0
    skipped: int = 0  # changed by a writer during the rewrite
    corrupt_keys: list[str] = field(default_factory=list)
    retired: list[int] = field(default_factory=list)  # files removed
    deferred: list[int] = field(default_factory=list)  # forgotten, removed at last unpin
    forgotten_bytes: int = 0  # file bytes of the sources the index no longer names

    @property
    def reclaimed_bytes(self) -> int:
        return self.forgotten_bytes - self.written_bytes


class _Copier:
    """Appends verified records in batches of about ``batch_bytes``: one positional write
    per batch instead of one per record keeps small records at sequential-write speed."""

    def __init__(self, appender: SegmentAppender, batch_bytes: int) -> None:
        self.appender = appender
        self.batch_bytes = batch_bytes
        self.batch: list[tuple[bytes, IndexEntry, memoryview]] = []
        self.size = 0
        self.moves: list[tuple[bytes, IndexEntry, IndexEntry]] = []
        self.meta_moves: list[tuple[bytes, IndexEntry, IndexEntry]] = []
        self._meta: set[tuple[bytes, IndexEntry]] = set()  # batched records that are meta

    async def add(self, key: bytes, entry: IndexEntry, record: memoryview,
                  meta: bool = False) -> None:
        self.batch.append((key, entry, record))
        if meta:
            self._meta.add((key, entry))
        self.size += record.nbytes
        if self.size >= self.batch_bytes:
            await self.write()

    async def write(self) -> None:
        if not self.batch:
            return
        seg_id, offset = await self.appender.append([r for _, _, r in self.batch], self.size)
        for key, entry, record in self.batch:
            moves = self.meta_moves if (key, entry) in self._meta else self.moves
            moves.append((key, entry, entry._replace(seg_id=seg_id, offset=offset)))
            offset += record.nbytes
        self.batch, self.size, self._meta = [], 0, set()


class Rewriter:
    """The compaction primitives over one tier directory: its index, segment files and
    ``compact.lock``; ``reserve_bytes`` is the medium's reserve (``headroom.py``)."""

    def __init__(self, path: Path, index: DiskIndex, files: SegmentFiles, segment_bytes: int,
                 compact_lock: DirLock, reserve_bytes: int) -> None:
        self.path = path
        self.index = index
        self.files = files
        self.segment_bytes = segment_bytes
        self.compact_lock = compact_lock
        self.reserve_bytes = reserve_bytes

    async def rewrite(self, seg_ids: list[int]) -> RewriteResult:
        """Copy the live records of these SEALED segments, switch, remove the sources.
        ``TierFull`` when the copies would take more than half of the reserve or the
        medium fills; ``InvalidRequest`` for a segment that is not SEALED."""
        infos = [info for info in map(self.index.segment, seg_ids) if info is not None]
        check_room(self.path, rewrite_need(infos), self.reserve_bytes // 2)
        try:
            return await self._rewrite(seg_ids)
        except OSError as exc:  # a read, open or unlink of the compaction's own
            raise storage_error(exc, "disk tier compaction") from exc

    async def _rewrite(self, seg_ids: list[int]) -> RewriteResult:
        seg_ids = list(dict.fromkeys(seg_ids))
        with self.compact_lock.holding():
            await asyncio.to_thread(self._sweep)
            infos = {}
            for seg_id in seg_ids:
                info = self.index.segment(seg_id)
                if info is None or info.state != SegState.SEALED:
                    state = "unknown" if info is None else info.state.name
                    raise InvalidRequest(f"segment {seg_id} is {state}: only SEALED "
                                         "segments are rewritten")
                infos[seg_id] = info
            result = RewriteResult(seg_ids, sum(i.file_bytes for i in infos.values()))
            live = await asyncio.to_thread(self._live, set(seg_ids))
            appender = SegmentAppender(self.index, self.files.directory, self.segment_bytes,
                                       SegState.BUILDING)
            copier = _Copier(appender, max(1, min(4 << 20, self.segment_bytes // 4)))
            try:
                for seg_id in seg_ids:
                    await self._copy(seg_id, live[seg_id], copier, result)
                built = await appender.finish()
                outcome = await asyncio.to_thread(self.index.switch, copier.moves, built,
                                                  seg_ids, copier.meta_moves)
            except BaseException:
                await appender.abort()
                raise
        result.new_segments = sorted(built)
        result.written_bytes = sum(built.values())
        result.moved, result.skipped = outcome.moved, outcome.skipped
        result.forgotten_bytes = sum(infos[s].file_bytes for s in outcome.emptied)
        for seg_id in outcome.emptied:
            (result.retired if self.files.retire(seg_id) else result.deferred).append(seg_id)
        return result

    async def _copy(self, seg_id: int, live: list[tuple[bytes, IndexEntry, bool]],
                    copier: _Copier, result: RewriteResult) -> None:
        """Copy one source's verified records; a corrupt chunk's key goes to ``result``."""
        self.files.pin(seg_id)
        try:
            for kb, entry, meta in live:
                size = record_size(len(kb), entry.value_len)

                def whole(record: memoryview, kb=kb, entry=entry) -> memoryview:
                    check_record(record, kb, entry.value_len, entry.checksum,
                                 f"segment {seg_id} @ {entry.offset}", None)
                    return record

                try:
                    record = await self.files.read(seg_id, entry.offset, size, whole)
                except ChunkTruncated:
                    raise  # the file ends inside a committed record: not a bad copy
                except ChunkCorrupt:
                    if not meta:  # a bad meta record keeps its segment alive
                        result.corrupt_keys.append(kb.decode(errors="replace"))
                    continue
                await copier.add(kb, entry, record, meta)
            await copier.write()  # no batch outlives its source's pin
        finally:
            self.files.unpin(seg_id)

    async def sweep(self) -> tuple[list[int], list[int]]:
        """Remove what crashed compactions and retirements left: abandoned BUILDING
        segments and segment files the index no longer names. Returns (unnamed, building)
        ids."""
        with self.compact_lock.holding():
            return await asyncio.to_thread(self._sweep)

    def _sweep(self) -> tuple[list[int], list[int]]:
        building = drop_abandoned_builds(self.index, self.files.directory)
        return remove_unnamed_files(self.index, self.files.directory), building

    def _live(self, seg_ids: set[int]) -> dict[int, list[tuple[bytes, IndexEntry, bool]]]:
        """Per segment its live chunk records and metadata records (True), in offset
        order."""
        chunks = self.index.live_entries(seg_ids)
        metas = self.index.live_meta_records(seg_ids)
        return {seg_id: sorted([(k, e, False) for k, e in chunks[seg_id]]
                               + [(k, e, True) for k, e in metas[seg_id]],
                               key=lambda item: item[1].offset)
                for seg_id in seg_ids}

    async def retire(self, seg_id: int) -> bool:
        """Forget a segment no entry names and remove its file once unpinned.

        Returns True when the file is gone now, False when removal waits for the last
        pin. Raises ``InvalidRequest`` for an ACTIVE or BUILDING segment or one still
        named.
        """
        info = self.index.segment(seg_id)
        if info is not None:
            if info.state != SegState.SEALED:
                raise InvalidRequest(f"segment {seg_id} is {info.state.name}; only a "
                                     "SEALED segment can be retired")
            if not await asyncio.to_thread(self.index.drop_segment, seg_id):
                raise InvalidRequest(f"segment {seg_id} still holds live records; "
                                     "rewrite them first")
        return self.files.retire(seg_id)
