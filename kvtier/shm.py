"""Same-host fast path: chunk bytes through POSIX shared memory, control over gRPC.

Who creates a segment owns it and registers it with ``multiprocessing``'s resource
tracker, so a crashed creator's segments are still removed. The other side only maps
it by name (``attach``: open + mmap of ``/dev/shm/<name>``, no tracker involvement):

- Spill: the client packs every payload into one segment (``SegmentWriter``), sends
  references, and unlinks it when the call returns, however it returns. The server
  copies the referenced bytes out (``Attachments``) before it answers.
- Restore/Resume: when the client lends a segment of its own (``reply_buffer``, reused
  call after call so its pages are warm) and the session fits, the server writes into
  it (``BufferWriter``). Otherwise the server packs the session into one segment per
  call (``RestoreSegments.create``); the client maps it at the first reference and
  unlinks the name at once (its mapping stays valid), so nothing outlives the client's
  reads; a segment the client never claimed is unlinked by the server when its lease
  ends (``RestoreSegments.reap``) or at shutdown (``close``).

Linux only (``available()``): elsewhere clients send bytes inline.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import re
import secrets
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

from kvstore.errors import InvalidRequest
from kvtier.errors import SharedMemoryUnavailable
from proto import kvtier_pb2 as pb

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class Mapping:
    """A read-write mapping of an existing segment, closed explicitly."""

    def __init__(self, name: str) -> None:
        if not _NAME.match(name):
            raise InvalidRequest(f"bad shared memory segment name {name!r}")
        self.name = name
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            raise SharedMemoryUnavailable(
                f"shared memory segment {name!r} does not exist here: client and server "
                "must share a host (and /dev/shm)") from None
        try:
            size = os.fstat(fd).st_size
            # Populated up front: one call maps every page instead of a fault per page.
            self._map = mmap.mmap(fd, size, flags=_MAP_FLAGS) if size else None
        finally:
            os.close(fd)
        self.size = size

    def _check(self, offset: int, length: int) -> None:
        if offset + length > self.size:
            raise InvalidRequest(f"shared memory ref {self.name}[{offset}:{offset + length}] "
                                 f"is beyond the segment's {self.size} bytes")

    def read(self, offset: int, length: int) -> bytes:
        """A copy of the bytes (the mapping may be closed afterwards)."""
        self._check(offset, length)
        return self._map[offset : offset + length] if length else b""

    def view(self, offset: int, length: int) -> memoryview:
        """The bytes in place, read-only: no copy. The mapping then stays until the last
        view is gone (do not ``close`` it; garbage collection unmaps it)."""
        self._check(offset, length)
        if not length:
            return memoryview(b"")
        return memoryview(self._map)[offset : offset + length].toreadonly()

    def unlink(self) -> None:
        """Remove the name (our mapping stays valid until ``close``)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / self.name)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


class BufferWriter:
    """Writes payloads into a segment the client lent for one call (``reply_buffer``)."""

    def __init__(self, ref: pb.SharedMemoryRef) -> None:
        self.mapping = Mapping(ref.name)
        self.capacity = min(self.mapping.size, ref.length)
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.capacity

    def add(self, data) -> pb.SharedMemoryRef:
        view = memoryview(data).cast("B")
        start = self.used
        self.mapping._map[start : start + len(view)] = view
        self.used += len(view)
        return pb.SharedMemoryRef(name=self.mapping.name, offset=start, length=len(view))

    def close(self) -> None:
        self.mapping.close()


class Attachments:
    """The client segments one call refers to, each mapped once; ``close`` unmaps all."""

    def __init__(self, max_segments: int = 16) -> None:
        self._maps: dict[str, Mapping] = {}
        self._max = max_segments

    def read(self, ref: pb.SharedMemoryRef, max_length: int) -> bytes:
        """Copy the referenced bytes out of the client's segment."""
        if ref.length > max_length:
            raise InvalidRequest(f"shared memory payload of {ref.length} B exceeds the "
                                 f"{max_length} B limit")
        mapping = self._maps.get(ref.name)
        if mapping is None:
            if len(self._maps) >= self._max:
                raise InvalidRequest(f"one call may refer to at most {self._max} segments")
            mapping = self._maps[ref.name] = Mapping(ref.name)
        return mapping.read(ref.offset, ref.length)

    def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()


class SegmentWriter:
    """One created segment filled front to back; ``add`` returns the reference to send."""

    def __init__(self, size: int, prefix: str) -> None:
        self.segment = shared_memory.SharedMemory(
            name=f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}", create=True,
            size=max(1, size))
        self.used = 0

    @property
    def name(self) -> str:
        return self.segment.name

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.segment.size

    def add(self, data) -> pb.SharedMemoryRef:
        view = memoryview(data).cast("B")
        start = self.used
        self.segment.buf[start : start + len(view)] = view
        self.used += len(view)
        return pb.SharedMemoryRef(name=self.name, offset=start, length=len(view))

    def close(self) -> None:
        """Unmap; the name stays until ``unlink``."""
        self.segment.close()

    def unlink(self) -> None:
        try:
            self.segment.unlink()
        except FileNotFoundError:  # the other side removed the name: balance our tracker
            resource_tracker.unregister(self.segment._name, "shared_memory")


class SegmentPool:
    """A client's spill segments, reused call after call (pages fault in once); one per
    concurrent call. ``close`` unlinks them all."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._free: list[SegmentWriter] = []

    def acquire(self, size: int) -> SegmentWriter:
        for i, writer in enumerate(self._free):
            if writer.segment.size >= size:
                writer.used = 0
                return self._free.pop(i)
        return SegmentWriter(size, self.prefix)

    def release(self, writer: SegmentWriter) -> None:
        self._free.append(writer)
        if len(self._free) > 4:  # keep the few largest
            self._free.sort(key=lambda w: w.segment.size)
            self.discard(self._free.pop(0))

    @staticmethod
    def discard(writer: SegmentWriter) -> None:
        writer.close()
        writer.unlink()

    def close(self) -> None:
        for writer in self._free:
            writer.close()
            writer.unlink()
        self._free.clear()


@dataclass
class _Lease:
    writer: SegmentWriter
    deadline: float


class RestoreSegments:
    """The server's restore segments, each unlinked when its lease ends at the latest."""

    def __init__(self, lease_s: float, prefix: str = "kvtier-r") -> None:
        self.lease_s = lease_s
        self.prefix = prefix
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._leases)

    def create(self, size: int) -> tuple[int, SegmentWriter]:
        self.reap()
        writer = SegmentWriter(size, self.prefix)
        lease_id = next(self._ids)
        self._leases[lease_id] = _Lease(writer, time.monotonic() + self.lease_s)
        return lease_id, writer

    def done_writing(self, lease_id: int) -> None:
        """The call ended: unmap now, keep the name for the client until the lease ends."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.writer.close()

    def reap(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expired = [i for i, lease in self._leases.items() if lease.deadline <= now]
        for lease_id in expired:
            self._release(lease_id)
        return len(expired)

    def close(self) -> None:
        for lease_id in list(self._leases):
            self._release(lease_id)

    def _release(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        lease.writer.close()
        lease.writer.unlink()
