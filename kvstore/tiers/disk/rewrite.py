"""Compaction primitives of the disk tier: rewrite live records, switch, retire.

Protocol (what keeps every step crash-safe and safe beside a live writer):

1. Take ``compact.lock`` (``Busy`` if another compaction runs) and ``sweep``: remove
   BUILDING segments an earlier, killed compaction left behind and files whose removal
   a crash cut short.
2. Only SEALED segments are rewritten; the writer never touches them again.
3. Copy each live record, verified, into new segments registered as BUILDING (named in
   the index before their files exist, named by no entry), then fsync them.
4. One LMDB transaction: each moved entry is switched by compare-and-swap (a put or
   delete the writer committed meanwhile wins, and its copy is just dead bytes), the
   new segments become SEALED, and every source segment no entry names any more is
   forgotten.
5. Only then are forgotten source files removed: at once when no reader here pins
   them, else at the last unpin. Readers in another process hold open descriptors (an
   unlinked file stays readable through them) or find the file gone and look the key
   up again, which now names the copy.

A crash before 4 leaves BUILDING segments and the old entries intact; a crash after 4
leaves unnamed files; the next compaction's sweep or writer open removes either.
Records that fail their checksum are not copied: their entries keep naming the old
segment, which therefore stays, and their keys are reported for the caller (the
scrub) to quarantine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.format.errors import ChunkCorrupt, InvalidRequest
from kvstore.tiers.disk.index import IndexEntry, SegState
from kvstore.tiers.disk.log import SegmentAppender
from kvstore.tiers.disk.recovery import drop_abandoned_builds, remove_unnamed_files
from kvstore.tiers.disk.segments import check_record, record_size, segment_path

if TYPE_CHECKING:
    from kvstore.tiers.disk.tier import DiskTier


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


async def rewrite_segments(tier: DiskTier, seg_ids: list[int]) -> RewriteResult:
    seg_ids = list(dict.fromkeys(seg_ids))
    with tier.compact_lock.holding():
        await asyncio.to_thread(_sweep, tier)
        infos = {}
        for seg_id in seg_ids:
            info = tier.index.segment(seg_id)
            if info is None or info.state != SegState.SEALED:
                state = "unknown" if info is None else info.state.name
                raise InvalidRequest(f"segment {seg_id} is {state}: only SEALED segments "
                                     "are rewritten")
            infos[seg_id] = info
        result = RewriteResult(seg_ids, sum(i.file_bytes for i in infos.values()))
        live = await asyncio.to_thread(_live, tier, set(seg_ids))
        appender = SegmentAppender(tier.index, tier.segment_dir, tier.segment_bytes,
                                   SegState.BUILDING)
        copier = _Copier(appender, max(1, min(4 << 20, tier.segment_bytes // 4)))
        try:
            for seg_id in seg_ids:
                tier.files.pin(seg_id)
                try:
                    for kb, entry, meta in live[seg_id]:
                        size = record_size(len(kb), entry.value_len)
                        record = await tier.files.read(seg_id, entry.offset, size)
                        try:
                            check_record(record, kb, entry.value_len, entry.checksum,
                                         f"segment {seg_id} @ {entry.offset}")
                        except ChunkCorrupt:
                            if not meta:  # a bad meta record keeps its segment alive
                                result.corrupt_keys.append(kb.decode(errors="replace"))
                            continue
                        await copier.add(kb, entry, record, meta)
                    await copier.write()  # no batch outlives its source's pin
                finally:
                    tier.files.unpin(seg_id)
            built = await appender.finish()
            outcome = await asyncio.to_thread(tier.index.switch, copier.moves, built, seg_ids,
                                              copier.meta_moves)
        except BaseException:
            await appender.close()
            await asyncio.to_thread(discard, tier, appender)
            raise
    result.new_segments = sorted(built)
    result.written_bytes = sum(built.values())
    result.moved, result.skipped = outcome.moved, outcome.skipped
    result.forgotten_bytes = sum(infos[s].file_bytes for s in outcome.emptied)
    for seg_id in outcome.emptied:
        (result.retired if tier.files.retire(seg_id) else result.deferred).append(seg_id)
    return result


async def sweep(tier: DiskTier) -> tuple[list[int], list[int]]:
    """Remove what crashed compactions and retirements left: abandoned BUILDING segments
    and segment files the index no longer names. Returns (unnamed, building) ids."""
    with tier.compact_lock.holding():
        return await asyncio.to_thread(_sweep, tier)


def _sweep(tier: DiskTier) -> tuple[list[int], list[int]]:
    building = drop_abandoned_builds(tier.index, tier.segment_dir)
    return remove_unnamed_files(tier.index, tier.segment_dir), building


def _live(tier: DiskTier, seg_ids: set[int]) -> dict[int, list[tuple[bytes, IndexEntry, bool]]]:
    """Per segment its live chunk records and metadata records (True), in offset order."""
    chunks = tier.index.live_entries(seg_ids)
    metas = tier.index.live_meta_records(seg_ids)
    return {seg_id: sorted([(k, e, False) for k, e in chunks[seg_id]]
                           + [(k, e, True) for k, e in metas[seg_id]],
                           key=lambda item: item[1].offset)
            for seg_id in seg_ids}


def discard(tier: DiskTier, appender: SegmentAppender) -> None:
    """Remove the BUILDING segments of an aborted write (no entry names them)."""
    seg_ids = set(appender.finished)
    if appender.seg_id is not None:
        seg_ids.add(appender.seg_id)
    for seg_id in seg_ids:
        if tier.index.drop_segment(seg_id):
            tier.fs.unlink(segment_path(tier.segment_dir, seg_id))


async def retire_segment(tier: DiskTier, seg_id: int) -> bool:
    """Forget a segment no entry names and remove its file once unpinned.

    Returns True when the file is gone now, False when removal waits for the last pin.
    Raises ``InvalidRequest`` for an ACTIVE or BUILDING segment or one still named.
    """
    info = tier.index.segment(seg_id)
    if info is not None:
        if info.state != SegState.SEALED:
            raise InvalidRequest(f"segment {seg_id} is {info.state.name}; only a SEALED "
                                 "segment can be retired")
        if not await asyncio.to_thread(tier.index.drop_segment, seg_id):
            raise InvalidRequest(f"segment {seg_id} still holds live records; rewrite "
                                 "them first")
    return tier.files.retire(seg_id)
