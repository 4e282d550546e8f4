"""Appending records to segment files through aiofiles, with sealing at a size limit.

A ``SegmentAppender`` owns one open segment at a time. It registers every new segment in
the index before creating its file, writes records with aiofiles, seals a segment
(fsync, then close) when the next record would take it past ``segment_bytes``, and on a
failed write cuts the file back to where the record began, so a failed append leaves
nothing behind. Callers serialise ``append`` (the tier holds one append lock).

The writer's appender makes ACTIVE segments; a compaction's makes BUILDING ones, which
stay unnamed by any entry until the compaction's switch transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from pathlib import Path

import aiofiles

from kvstore.errors import TierFull, TierUnavailable
from kvstore.tiers.base import Buffer
from kvstore.tiers.disk.index import DiskIndex, SegState
from kvstore.tiers.disk.segments import fsync_directory, segment_path

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
                 state: SegState) -> None:
        self.index = index
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.state = state
        self.seg_id: int | None = None
        self.end = 0
        self._file = None
        self.finished: dict[int, int] = {}  # segment id -> final size, sealed by this one

    def _error(self, exc: OSError, what: str) -> TierFull | TierUnavailable:
        return storage_error(exc, f"disk tier {self.directory.parent}: {what}")

    async def resume(self, seg_id: int, end: int) -> None:
        """Continue an ACTIVE segment whose file was already cut back to ``end``."""
        self._file = await aiofiles.open(segment_path(self.directory, seg_id), "ab")
        self.seg_id, self.end = seg_id, end

    async def append(self, parts: list[Buffer], size: int) -> tuple[int, int]:
        """Write one record made of ``parts`` (``size`` bytes in all); returns (segment id,
        offset). A segment sealed to make room shows up in ``take_sealed``."""
        if self._file is None or (self.end and self.end + size > self.segment_bytes):
            await self.roll()
        offset = self.end
        try:
            await self._file.writelines(parts)
            await self._file.flush()
        except OSError as exc:
            await self._cut_back(offset)
            raise self._error(exc, f"writing segment {self.seg_id}") from exc
        self.end = offset + size
        return self.seg_id, offset

    def take_sealed(self) -> list[tuple[int, int]]:
        """(segment id, size) of segments sealed since the last call."""
        sealed, self.finished = list(self.finished.items()), {}
        return sealed

    async def roll(self) -> None:
        """Seal the open segment (if any) and start a new one."""
        if self._file is not None:
            await self.sync()
            await self._file.close()
            self.finished[self.seg_id] = self.end
            self._file = None
        seg_id = await asyncio.to_thread(self.index.register_segment, self.state)
        path = segment_path(self.directory, seg_id)
        try:
            self._file = await aiofiles.open(path, "ab")
            await asyncio.to_thread(fsync_directory, self.directory)
        except OSError as exc:
            self.seg_id, self._file = None, None
            raise self._error(exc, f"creating segment {seg_id}") from exc
        self.seg_id, self.end = seg_id, 0

    async def sync(self) -> None:
        """fsync the open segment's bytes (the payload half of a durable write)."""
        if self._file is not None:
            try:
                await asyncio.to_thread(os.fsync, self._file.fileno())
            except OSError as exc:
                raise self._error(exc, f"syncing segment {self.seg_id}") from exc

    async def cut_back(self, end: int) -> None:
        """Discard everything past ``end`` in the open segment (after a failed commit)."""
        await self._cut_back(end)
        self.end = end

    async def _cut_back(self, end: int) -> None:
        path = segment_path(self.directory, self.seg_id)
        with contextlib.suppress(OSError):  # close retries the failed flush; cut below
            await self._file.close()
        self._file = None
        try:
            await asyncio.to_thread(os.truncate, path, end)
            self._file = await aiofiles.open(path, "ab")
        except OSError:
            self.seg_id = None  # the next append starts a fresh segment

    async def finish(self) -> dict[int, int]:
        """Seal the open segment; every segment this appender wrote, id -> size."""
        if self._file is not None:
            await self.sync()
            await self._file.close()
            self.finished[self.seg_id] = self.end
            self._file = None
        return self.finished

    async def close(self) -> None:
        if self._file is not None:
            await self._file.close()
            self._file = None
