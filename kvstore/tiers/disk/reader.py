"""Reading records from segment files: cached descriptors, pins, deferred removal.

A record is read with ``os.preadv`` into a fresh buffer: first with ``RWF_NOWAIT`` on the
event loop, which copies what the page cache holds and never waits on the device, then
the rest in a worker thread, one large read. (Not a mapping: a record whose first and
last pages are cached would fault the others in on the event loop.) ``read_runs`` reads
several runs into one buffer in one thread call.

Pins: a reader pins the segment it reads; ``retire`` removes a segment file at once when
it is unpinned, else at the last unpin. Another process (the offline compactor) cannot
see these pins and removes a file only after the index stops naming it: a descriptor
already open keeps the unlinked file readable, and a segment whose file is gone before
it was opened raises ``SegmentGone``, so the caller looks the key up again.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np

from kvstore.format.errors import ChunkTruncated
from kvstore.tiers.disk.fs import OS, FileSystem
from kvstore.tiers.disk.segments import segment_path

log = logging.getLogger(__name__)

_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


class SegmentGone(Exception):
    """The segment file was removed (retired) before this process opened it."""


def _pread_into(fs: FileSystem, fd: int, buffer: memoryview, offset: int) -> int:
    done = 0
    while done < buffer.nbytes:
        count = fs.read(fd, buffer[done:], offset + done)
        if count == 0:
            break
        done += count
    return done


class SegmentFiles:
    def __init__(self, directory: Path, *, max_open: int = 256, fs: FileSystem = OS) -> None:
        self.directory = directory
        self.fs = fs
        self.max_open = max_open
        self._fds: OrderedDict[int, int] = OrderedDict()  # LRU of read descriptors
        self._pins: Counter[int] = Counter()
        self._retiring: set[int] = set()
        self._nowait = _NOWAIT

    def pin(self, seg_id: int) -> None:
        self._pins[seg_id] += 1

    def unpin(self, seg_id: int) -> None:
        self._pins[seg_id] -= 1
        if self._pins[seg_id] <= 0:
            del self._pins[seg_id]
            if seg_id in self._retiring:
                self._remove(seg_id)

    def pinned(self, seg_id: int) -> int:
        return self._pins[seg_id]

    def retire(self, seg_id: int) -> bool:
        """Remove the segment's file now if unpinned (True), else after the last unpin."""
        if self._pins[seg_id]:
            self._retiring.add(seg_id)
            return False
        self._remove(seg_id)
        return True

    def _remove(self, seg_id: int) -> None:
        self._retiring.discard(seg_id)
        self._close(seg_id)
        # another process (or a recovery) may have removed it first
        try:
            self.fs.unlink(segment_path(self.directory, seg_id))
        except OSError as exc:  # unnamed now: the next sweep or writer open removes it
            log.warning("segment %d: removing its file failed, left for the next sweep: %s",
                        seg_id, exc)

    def _close(self, seg_id: int) -> None:
        fd = self._fds.pop(seg_id, None)
        if fd is not None:
            self.fs.close(fd)

    def forget_except(self, named: set[int]) -> None:
        """Close descriptors of unpinned segments the index no longer names."""
        for seg_id in [s for s in self._fds if s not in named and not self._pins[s]]:
            self._close(seg_id)

    def descriptor(self, seg_id: int) -> int:
        fd = self._fds.get(seg_id)
        if fd is not None:
            self._fds.move_to_end(seg_id)
            return fd
        try:
            fd = self.fs.open(segment_path(self.directory, seg_id), os.O_RDONLY)
        except FileNotFoundError:
            raise SegmentGone(seg_id) from None
        self._fds[seg_id] = fd
        while len(self._fds) > self.max_open:
            victim = next((s for s in self._fds if not self._pins[s] and s != seg_id), None)
            if victim is None:
                break
            self._close(victim)
        return fd

    async def read(self, seg_id: int, offset: int, size: int) -> memoryview:
        """A read-only copy of ``size`` bytes at ``offset``; the caller holds a pin."""
        fd = self.descriptor(seg_id)
        # np.empty, not bytearray: the read fills it, and zero-filling first costs as much
        buffer = memoryview(np.empty(size, dtype=np.uint8))
        done = self._cached_part(fd, buffer, offset)
        if done < size:
            done += await asyncio.to_thread(_pread_into, self.fs, fd, buffer[done:],
                                            offset + done)
        if done < size:
            log.warning("segment %d: %d bytes at offset %d requested, the file ends after %d",
                        seg_id, size, offset, done)
            raise ChunkTruncated("disk tier: a record runs past the end of its segment")
        return buffer.toreadonly()

    def read_runs(self, runs: list[tuple[int, int, int]], buffer: memoryview) -> None:
        """Blocking (run it in a worker thread): read each (descriptor, offset, size) run
        into ``buffer``, back to back; ``ChunkTruncated`` if a file ends inside one."""
        at = 0
        for fd, offset, size in runs:
            if _pread_into(self.fs, fd, buffer[at:at + size], offset) < size:
                raise ChunkTruncated("disk tier: a record runs past the end of its segment")
            at += size

    def _cached_part(self, fd: int, buffer: memoryview, offset: int) -> int:
        """The bytes of the range the page cache holds from its start, copied without
        waiting on the device (``RWF_NOWAIT``): all of it for a hot record, 0 for a
        cold one."""
        if not self._nowait:
            return 0
        try:
            return self.fs.read(fd, buffer, offset, self._nowait)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            log.info("RWF_NOWAIT unsupported in %s; reading in threads", self.directory)
            self._nowait = 0
            return 0

    def close(self) -> None:
        for seg_id in list(self._fds):
            self._close(seg_id)
