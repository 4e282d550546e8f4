"""Reading records from segment files: cached descriptors, pins, deferred removal.

Reads do not go through aiofiles. A record whose bytes are in the page cache (two
``RWF_NOWAIT`` one-byte probes, at its first and last byte, say so without blocking) is
returned as a zero-copy read-only view of the segment's mmap, so a get costs little
more than its checksum; a record that would wait on the device is read with
``os.preadv`` in a worker thread, one large read instead of page faults, and never
blocks the event loop. The probes also prove the file still holds the whole range
before the mapping is touched; like LMDB's own reads, a mapping is only unsafe if
someone truncates a segment file behind the store's back at that very moment.

Pins: a reader pins the segment it reads; ``retire`` removes a segment file at once when
it is unpinned, otherwise when the last pin goes. Another process (the offline
compactor) cannot see these pins; it removes a segment file only after the index stops
naming it, and a read here survives that: a descriptor already open keeps the unlinked
file's bytes readable, and a segment whose file is gone before it was opened raises
``SegmentGone`` so the caller looks the key up again.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np

from kvstore.errors import ChunkTruncated
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
        self._maps: dict[int, object] = {}  # seg id -> mmap.mmap
        self._nowait = _NOWAIT
        self._probe = bytearray(1)

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
        # a mapping is dropped, never closed: views handed out keep it alive
        self._maps.pop(seg_id, None)
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
        """A read-only view of ``size`` bytes at ``offset``; the caller holds a pin."""
        fd = self.descriptor(seg_id)
        view = self._mapped(seg_id, fd, offset, offset + size)
        if view is not None:
            return view
        # np.empty, not bytearray: zero-filling 1 MiB first costs as much as the read
        buffer = memoryview(np.empty(size, dtype=np.uint8))
        done = await asyncio.to_thread(_pread_into, self.fs, fd, buffer, offset)
        if done < size:
            log.warning("segment %d: %d bytes at offset %d requested, the file ends after %d",
                        seg_id, size, offset, done)
            raise ChunkTruncated("disk tier: a record runs past the end of its segment")
        return buffer.toreadonly()

    def _mapped(self, seg_id: int, fd: int, offset: int, end: int) -> memoryview | None:
        """A zero-copy view from the segment's mapping when the range looks cached: its
        first and last bytes are (RWF_NOWAIT probes), which also proves the file still
        reaches ``end``. None sends the read to a worker thread instead."""
        if not self._nowait:
            return None
        try:
            probe = memoryview(self._probe)
            if (self.fs.read(fd, probe, offset, self._nowait) != 1
                    or self.fs.read(fd, probe, end - 1, self._nowait) != 1):
                return None
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            log.info("RWF_NOWAIT unsupported in %s; reading in threads", self.directory)
            self._nowait = 0
            return None
        mapped = self._maps.get(seg_id)
        if mapped is None or len(mapped) < end:
            mapped = self.fs.mmap(fd)  # the whole file as it is now
            self._maps[seg_id] = mapped
        return memoryview(mapped)[offset:end] if len(mapped) >= end else None

    def close(self) -> None:
        for seg_id in list(self._fds):
            self._close(seg_id)
