"""Reading records from segment files: cached descriptors, pins, deferred removal.

``read`` serves a record the page cache holds (``RWF_NOWAIT`` one-byte probes of its
first and last byte say so without blocking) of at least ``MAP_MIN_BYTES`` as a
zero-copy view of the segment's mapping, verified in a worker thread: a page that only
looked cached faults in there, never on the event loop, and the view is returned only
once every byte of it passed the check. Any other record is read with ``os.preadv``
into a fresh buffer: first with ``RWF_NOWAIT`` on the event loop (what the page cache
holds, without waiting on the device), the rest in a worker thread, one large read,
verified in that thread. ``read_runs`` reads several runs into one buffer (blocking, for
a worker thread), after ``prefetch`` told the kernel every range a batch will read. A
mapping only ever covers committed records, which no one truncates.

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
import mmap
import os
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore.format.errors import ChunkTruncated
from kvstore.tiers.disk.fs import OS, FileSystem
from kvstore.tiers.disk.segments import segment_path

log = logging.getLogger(__name__)

_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
MAP_MIN_BYTES = 1 << 18  # smaller cached records are copied: a copy costs less than a thread hop
INLINE_CHECK_BYTES = 1 << 16  # copied records at least this large are checked off the loop

# The verified value of a whole record, or ChunkCorrupt; called in a worker thread.
Check = Callable[[memoryview], memoryview]


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
        self._maps: dict[int, mmap.mmap] = {}  # seg id -> the segment mapped
        self._nowait = _NOWAIT
        self._probe = memoryview(bytearray(1))

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
        self._maps.pop(seg_id, None)  # dropped, not closed: views handed out keep it alive
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

    async def read(self, seg_id: int, offset: int, size: int, check: Check) -> memoryview:
        """``check`` of the ``size`` bytes at ``offset`` (read-only); the caller holds a
        pin. ``ChunkTruncated`` if the file ends first."""
        fd = self.descriptor(seg_id)
        view = self._mapped(seg_id, fd, offset, size) if size >= MAP_MIN_BYTES else None
        if view is not None:
            return await asyncio.to_thread(check, view)
        # np.empty, not bytearray: the read fills it, and zero-filling first costs as much
        buffer = np.empty(size, dtype=np.uint8).data
        done = self._cached_part(fd, buffer, offset)
        if done == size:
            whole = buffer.toreadonly()
            return check(whole) if size < INLINE_CHECK_BYTES else await asyncio.to_thread(
                check, whole)

        def rest() -> memoryview:
            got = done + _pread_into(self.fs, fd, buffer[done:], offset + done)
            if got < size:
                log.warning("segment %d: %d bytes at offset %d requested, the file ends "
                            "after %d", seg_id, size, offset, got)
                raise ChunkTruncated("disk tier: a record runs past the end of its segment")
            return check(buffer.toreadonly())

        return await asyncio.to_thread(rest)

    def _mapped(self, seg_id: int, fd: int, offset: int, size: int) -> memoryview | None:
        """A view of the range from the segment's mapping when its first and last bytes
        are cached (which also proves the file reaches its end); else None."""
        if not self._nowait or not hasattr(self.fs, "mmap"):
            return None
        end = offset + size
        try:
            if (self.fs.read(fd, self._probe, offset, self._nowait) != 1
                    or self.fs.read(fd, self._probe, end - 1, self._nowait) != 1):
                return None
        except BlockingIOError:
            return None
        except OSError as exc:
            self._nowait_failed(exc)
            return None
        mapped = self._maps.get(seg_id)
        if mapped is None or len(mapped) < end:
            mapped = self._maps[seg_id] = self.fs.mmap(fd)
        return memoryview(mapped)[offset:end] if len(mapped) >= end else None

    def prefetch(self, runs: list[tuple[int, int, int]]) -> None:
        """Blocking: ask the kernel to start reading each (descriptor, offset, size) run,
        so the device has a batch's ranges at once while they are read in order. Only a
        hint: a file system that refuses it is read without it."""
        if not hasattr(self.fs, "willneed"):
            return
        for fd, offset, size in runs:
            try:
                self.fs.willneed(fd, offset, size)
            except OSError:
                return

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
            self._nowait_failed(exc)
            return 0

    def _nowait_failed(self, exc: OSError) -> None:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise exc
        log.info("RWF_NOWAIT unsupported in %s; reading in threads", self.directory)
        self._nowait = 0

    def close(self) -> None:
        for seg_id in list(self._fds):
            self._close(seg_id)
