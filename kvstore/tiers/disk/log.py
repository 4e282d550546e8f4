"""Appending records to segment files, with sealing at a size limit.

A ``SegmentAppender`` owns one open segment at a time. It registers every new segment in
the index before creating its file (then fsyncs the directory, so a segment whose
records are committed never loses its name), writes each record with one positional
write at the segment's end, and seals a segment (fsync, then close) when the next
record would take it past ``segment_bytes``. Callers serialise ``append`` (the tier
holds one append lock). All file calls go through the index's ``FileSystem`` seam, in
worker threads.

A failed write leaves the appender usable, which is what lets the tier serve again as
soon as space returns: the segment is cut back to where the record began, and if even
that fails (or an fsync of the segment failed, after which the kernel may have dropped
its dirty pages) the segment is abandoned: sealed at its last good end, and the next
append starts a fresh segment. Bytes past a sealed segment's committed end are never
named by the index and recovery cuts them off.

The writer's appender makes ACTIVE segments; a compaction's makes BUILDING ones, which
stay unnamed by any entry until the compaction's switch transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from pathlib import Path

import lmdb

from kvstore.format.errors import TierFull, TierUnavailable
from kvstore.tiers.base import Buffer
from kvstore.tiers.disk.index import DiskIndex, SegState
from kvstore.tiers.disk.segments import segment_path

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def storage_error(exc: OSError | Exception, what: str) -> TierFull | TierUnavailable:
    """The tier error for an error met while writing: a full disk is TierFull."""
    code = getattr(exc, "errno", None)
    if code in _NO_SPACE or "No space left" in str(exc):
        reason = os.strerror(code) if code in _NO_SPACE else str(exc)
        return TierFull(f"{what}: no space left ({reason}); nothing was stored")
    return TierUnavailable(f"{what}: {exc}")


class SegmentAppender:
    def __init__(self, index: DiskIndex, directory: Path, segment_bytes: int,
                 state: SegState, failed_syncs: set[int] | None = None) -> None:
        """``failed_syncs``: segments whose fsync failed (shared with the commit
        pipeline); the appender never writes to one again."""
        self.index = index
        self.fs = index.fs
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.state = state
        self.failed_syncs = failed_syncs if failed_syncs is not None else set()
        self.seg_id: int | None = None
        self.end = 0
        self._fd: int | None = None
        self.finished: dict[int, int] = {}  # segment id -> final size, sealed by this one

    def _error(self, exc: Exception, what: str) -> TierFull | TierUnavailable:
        return storage_error(exc, f"disk tier: {what}")

    async def resume(self, seg_id: int, end: int) -> None:
        """Continue an ACTIVE segment whose file was already cut back to ``end``."""
        path = segment_path(self.directory, seg_id)
        self._fd = await asyncio.to_thread(self.fs.open, path, os.O_WRONLY)
        self.seg_id, self.end = seg_id, end

    async def append(self, parts: list[Buffer], size: int) -> tuple[int, int]:
        """Write one record made of ``parts`` (``size`` bytes in all); returns (segment id,
        offset). A segment sealed to make room shows up in ``take_sealed``."""
        if self._fd is not None and self.seg_id in self.failed_syncs:
            self._abandon()
        if self._fd is None or (self.end and self.end + size > self.segment_bytes):
            await self.roll()
        assert self._fd is not None and self.seg_id is not None  # a segment is open with its fd
        offset = self.end
        try:
            await asyncio.to_thread(self.fs.write, self._fd, parts, offset)
        except OSError as exc:
            seg_id = self.seg_id
            await self._cut_back(offset)
            raise self._error(exc, f"writing segment {seg_id}") from exc
        self.end = offset + size
        return self.seg_id, offset

    def take_sealed(self) -> list[tuple[int, int]]:
        """(segment id, size) of segments sealed since the last call."""
        sealed, self.finished = list(self.finished.items()), {}
        return sealed

    async def roll(self) -> None:
        """Seal the open segment (if any) and start a new one."""
        if self._fd is not None:
            await self.sync()
            self._abandon()
        try:
            seg_id = await asyncio.to_thread(self.index.register_segment, self.state)
        except lmdb.Error as exc:
            raise self._error(exc, "registering a new segment") from exc
        path = segment_path(self.directory, seg_id)
        fd = None
        try:
            fd = await asyncio.to_thread(self.fs.open, path,
                                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            await asyncio.to_thread(self.fs.fsync_dir, self.directory)
        except OSError as exc:
            if fd is not None:
                self._close_quietly(fd)
            self.finished[seg_id] = 0  # sealed empty, so it is never resumed
            raise self._error(exc, f"creating segment {seg_id}") from exc
        self._fd, self.seg_id, self.end = fd, seg_id, 0

    async def sync(self) -> None:
        """fsync the open segment's bytes (the payload half of a durable write). On
        failure the segment is abandoned: its unsynced pages cannot be trusted."""
        if self._fd is not None:
            try:
                await asyncio.to_thread(self.fs.fsync, self._fd)
            except OSError as exc:
                seg_id = self.seg_id
                assert seg_id is not None  # a segment is open with its fd
                self.failed_syncs.add(seg_id)
                self._abandon()
                raise self._error(exc, f"syncing segment {seg_id}") from exc

    async def _cut_back(self, end: int) -> None:
        """Discard a failed record's bytes; abandon the segment when that fails too."""
        assert self._fd is not None  # the record's segment is still open
        try:
            await asyncio.to_thread(self.fs.truncate, self._fd, end)
        except OSError:
            self._abandon()

    def _abandon(self) -> None:
        """Seal the open segment at its last good end and let it go."""
        fd, self._fd = self._fd, None
        if fd is not None:
            assert self.seg_id is not None  # a segment is open with its fd
            self.finished[self.seg_id] = self.end
            self._close_quietly(fd)
        self.seg_id, self.end = None, 0

    def _close_quietly(self, fd: int) -> None:
        with contextlib.suppress(OSError):  # the descriptor is released whatever close says
            self.fs.close(fd)

    async def finish(self) -> dict[int, int]:
        """Seal the open segment; every segment this appender wrote, id -> size."""
        await self.sync()
        self._abandon()
        return self.finished

    async def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._close_quietly(fd)

    async def abort(self) -> None:
        """Close, and remove the segments this BUILDING appender made (no entry names
        them): what an aborted compaction or attached meta write leaves."""
        await self.close()
        await asyncio.to_thread(self._discard)

    def _discard(self) -> None:
        seg_ids = set(self.finished)
        if self.seg_id is not None:
            seg_ids.add(self.seg_id)
        for seg_id in seg_ids:
            if self.index.drop_segment(seg_id):
                self.fs.unlink(segment_path(self.directory, seg_id))
