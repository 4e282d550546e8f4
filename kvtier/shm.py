"""Same-host fast path, client side: chunk bytes through POSIX shared memory, control over
gRPC. The server side (creating, leasing, reaping, bounding) is
``services.server.shm_leases``; the rules are in ``proto/kvtier.proto``.

Only the server creates segments; it hands out a ``SharedMemoryLease`` (lease id, name,
size) and the client maps ``/dev/shm/<name>`` (``Segment``), never creating, naming or
unlinking one. Payloads refer to ``(lease_id, offset, length)``:

- Spill: the client asks ``LeaseSegment`` for a segment, writes its payloads into it and
  sends references; the server copies them out before it answers.
- Restore/Resume/ReadChunks: the server writes the reply into a segment it names in the
  header (``reply_segment``); the client copies the payloads out, or lends the segment to
  a caller that reads a ReadChunks reply in place (``lend``) until it gives it back.
- ReadChunks in place: chunks the server's host tier holds are named where they lie, in
  its slabs (``ArenaSlab``: mapped read-only, kept by name, unmapped once the server
  removed them or has not named them for a read lease's time), pinned under a read
  lease the caller ends (``end_read``: batched into one ReleaseSegments, never waited
  on).

Either way the client keeps the segment (``ClientSegments``) and offers it again, to spill
into or as ``reply_lease``, so its pages stay warm; each use renews the lease. Leases it
stops using it releases (``ReleaseSegments``) or lets the server reap.

Linux only (``available()``): elsewhere clients send bytes inline.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from kvstore.format.chunk import Buffer
from kvstore.format.chunk_run import PackedRun
from kvstore.format.errors import (
    InvalidRequest,
    SharedMemoryExhausted,
    SharedMemoryUnavailable,
    TierFull,
)
from kvstore.format.shm_names import NAME, SHM_DIR
from kvstore.format.shm_names import PREFIX as PREFIX  # the names callers know it by
from kvstore.format.shm_names import available as available
from kvtier.errors import error_from_rpc
from proto import kvtier_pb2 as pb

RENEW_MARGIN = 0.8  # offer a lease again only within this share of its lease time
POOL_SIZE = 4  # segments a client keeps between calls
RELEASE_TIMEOUT_S = 2.0
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class Segment:
    """A server-created segment mapped read-write by the client holding its lease."""

    def __init__(self, lease: pb.SharedMemoryLease,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not NAME.match(lease.name):
            raise InvalidRequest(f"the server leased a segment named {lease.name!r}, "
                                 "which is not a kvtier segment name")
        self.lease_id = lease.lease_id
        self.lease_s = lease.lease_s
        self._clock = clock
        self.fresh_until = clock() + lease.lease_s * RENEW_MARGIN
        try:  # O_NOFOLLOW: a link planted under the name is not followed
            fd = os.open(SHM_DIR / lease.name, os.O_RDWR | os.O_NOFOLLOW)
        except (FileNotFoundError, PermissionError) as exc:
            raise SharedMemoryUnavailable(
                f"shared memory segment {lease.name!r} cannot be opened here ({exc.strerror}):"
                " client and server must share a host, /dev/shm and user") from None
        try:
            self.size = os.fstat(fd).st_size
            if self.size < lease.size or not self.size:
                raise SharedMemoryUnavailable(f"shared memory segment {lease.name!r} holds "
                                              f"{self.size} B, not the {lease.size} B leased")
            # Populated up front: one call maps every page instead of a fault per page.
            self._map = mmap.mmap(fd, self.size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)

    def used(self, started: float) -> None:
        """A call that began at ``started`` (this clock) used it: the server renewed it."""
        self.fresh_until = started + self.lease_s * RENEW_MARGIN

    def fresh(self) -> bool:
        return bool(self._clock() < self.fresh_until)

    def _check(self, ref: pb.SharedMemoryRef) -> None:
        if ref.lease_id != self.lease_id or ref.offset + ref.length > self.size:
            raise InvalidRequest(f"a reply refers to {ref.lease_id!r}[{ref.offset}:"
                                 f"{ref.offset + ref.length}], not to the {self.size} B of "
                                 f"lease {self.lease_id!r} the header named")

    def read(self, ref: pb.SharedMemoryRef) -> bytes:
        """A copy: the segment serves the next call."""
        self._check(ref)
        return self._map[ref.offset : ref.offset + ref.length]

    def view(self, ref: pb.SharedMemoryRef) -> memoryview:
        """The referenced bytes where they lie: valid while the segment is not offered
        for another reply (``ClientSegments.lend``)."""
        self._check(ref)
        return memoryview(self._map)[ref.offset : ref.offset + ref.length]

    def read_run(self, refs: list[pb.SharedMemoryRef]) -> PackedRun | None:
        """Payloads that lie back to back, copied out with one copy as a ``PackedRun``
        (decoded without joining them); None when they do not."""
        for ref in refs:
            self._check(ref)
        pairs = zip(refs, refs[1:], strict=False)
        if not refs or any(b.offset != a.offset + a.length for a, b in pairs):
            return None
        start, end = refs[0].offset, refs[-1].offset + refs[-1].length
        return PackedRun(self._map[start:end], [ref.length for ref in refs])

    def writer(self) -> PackedWriter:
        """Pack a Spill's payloads into this segment from its start."""
        return PackedWriter(self._map, self.lease_id)

    def close(self) -> None:
        """Unmap (the name is the server's to unlink); views a caller still holds keep
        the mapping until they are dropped."""
        with contextlib.suppress(BufferError):
            self._map.close()


class ArenaSlab:
    """One of the server's host-tier slabs, mapped read-only: chunks an in-place read
    pinned are read here, where they lie, until the client releases the read lease."""

    def __init__(self, described: pb.SharedMemoryLease, now: float) -> None:
        if not NAME.match(described.name):
            raise InvalidRequest(f"the server named a slab {described.name!r}, which is "
                                 "not a kvtier segment name")
        self.name = described.name
        self.named_at = now
        try:  # O_NOFOLLOW: a link planted under the name is not followed
            fd = os.open(SHM_DIR / described.name, os.O_RDONLY | os.O_NOFOLLOW)
        except (FileNotFoundError, PermissionError) as exc:
            raise SharedMemoryUnavailable(
                f"shared memory slab {described.name!r} cannot be opened here "
                f"({exc.strerror}): client and server must share a host, /dev/shm and user"
            ) from None
        try:
            self.size = os.fstat(fd).st_size
            if not self.size:
                raise SharedMemoryUnavailable(f"shared memory slab {described.name!r} is empty")
            # Not populated: only the slots read are ever touched, each once per mapping.
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def view(self, ref: pb.SharedMemoryRef) -> memoryview:
        """The referenced bytes, read-only, where they lie."""
        if ref.offset + ref.length > self.size:
            raise InvalidRequest(f"a reply refers to [{ref.offset}:{ref.offset + ref.length}]"
                                 f" of slab {self.name!r}, which holds {self.size} B")
        return memoryview(self._map)[ref.offset : ref.offset + ref.length]

    def close(self) -> None:
        """Unmap; views a caller still holds keep the mapping until they are dropped."""
        with contextlib.suppress(BufferError):
            self._map.close()


class PackedWriter:
    """Payloads packed front to back into one leased segment's mapping; ``add`` gives the
    ref. The client packs a Spill's payloads this way, the server a Restore's."""

    def __init__(self, mapping: mmap.mmap, lease_id: str) -> None:
        self.mapping = mapping
        self.lease_id = lease_id
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= len(self.mapping)

    def add(self, data: Buffer) -> pb.SharedMemoryRef:
        view = memoryview(data).cast("B")
        start = self.used
        self.mapping[start : start + len(view)] = view
        self.used += len(view)
        return pb.SharedMemoryRef(lease_id=self.lease_id, offset=start, length=len(view))


class ClientSegments:
    """The segments one client holds between calls (one per concurrent call, at most
    ``POOL_SIZE`` kept), leased from its server through ``stub``."""

    def __init__(self, stub: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._stub = stub
        self._clock = clock
        self._free: list[Segment] = []
        self._returning: set[asyncio.Future[None]] = set()  # lent segments being kept again
        self._slabs: dict[str, ArenaSlab] = {}  # the server's host-tier slabs, by name
        self._slab_idle_s = 0.0  # unmapped when the server has not named them this long
        self._reads_ending: list[str] = []  # read leases released, not yet told

    def _take(self, fits: Callable[[Segment], bool]) -> Segment | None:
        # Past its margin the server may reap it any moment: forget it, it will.
        for segment in [s for s in self._free if not s.fresh()]:
            self._free.remove(segment)
            segment.close()
        candidates = [s for s in self._free if fits(s)]
        if not candidates:
            return None
        segment = min(candidates, key=lambda s: s.size)
        self._free.remove(segment)
        return segment

    async def for_spill(self, size: int, timeout_s: float | None) -> Segment | None:
        """A segment of at least ``size`` bytes, kept or newly leased; None when the
        server refuses the lease (a bound reached): the bytes then go inline."""
        segment = self._take(lambda s: s.size >= size)
        if segment is not None:
            return segment
        try:
            lease = await self._stub.LeaseSegment(pb.LeaseRequest(size=round_up(size)),
                                                  timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            # a bound reached (TierFull: a server from before SharedMemoryExhausted)
            if isinstance(error_from_rpc(exc), (SharedMemoryExhausted, TierFull)):
                return None
            raise
        return await self.mapped(lease)

    def for_reply(self) -> Segment | None:
        """The largest kept segment, to offer as a restore's ``reply_lease``."""
        largest = max((s.size for s in self._free if s.fresh()), default=0)
        return self._take(lambda s: s.size == largest) if largest else None

    async def mapped(self, lease: pb.SharedMemoryLease) -> Segment:
        """Map a segment the server just leased us; one we cannot map we give back."""
        try:
            return Segment(lease, self._clock)
        except SharedMemoryUnavailable:
            await self._end([lease.lease_id])
            raise

    async def keep(self, segment: Segment, started: float) -> None:
        """A call that began at ``started`` used it (the server renewed the lease): keep
        it for the next call, releasing the smallest beyond ``POOL_SIZE``."""
        segment.used(started)
        self._free.append(segment)
        self._free.sort(key=lambda s: s.size, reverse=True)
        extra, self._free = self._free[POOL_SIZE:], self._free[:POOL_SIZE]
        await self.release(extra)

    def lend(self, segment: Segment, started: float) -> Callable[[], None]:
        """Lend ``segment``, just replied into by a call that began at ``started``, to a
        caller reading it in place: it is offered for no reply until the call returned is
        made (from any thread, once), which keeps it for the next call."""
        return _once_on_loop(self._give_back, segment, started)

    def _give_back(self, segment: Segment, started: float) -> None:
        task = asyncio.ensure_future(self.keep(segment, started))
        self._returning.add(task)
        task.add_done_callback(self._returning.discard)

    async def replied(self, used: list[Segment], segment: Segment | None,
                      started: float) -> None:
        """A reply that began at ``started`` came whole: of the segments it ``used``, the
        one its bytes were copied out of (``segment``) serves the next call; any other
        (offered, then replaced: the server released it) is closed."""
        for held in used:
            if held is not segment:
                held.close()
        if segment is not None:
            await self.keep(segment, started)

    async def release(self, segments: Iterable[Segment]) -> None:
        """Unmap segments we stop using and end their leases (best effort: the server
        reaps them at their lease end anyway)."""
        for segment in segments:
            segment.close()
        await self._end([s.lease_id for s in segments])

    async def _end(self, lease_ids: list[str]) -> None:
        if lease_ids:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.ReleaseSegments(pb.ReleaseRequest(lease_ids=lease_ids),
                                                 timeout=RELEASE_TIMEOUT_S)

    def slabs(self, described: Iterable[pb.SharedMemoryLease]) -> dict[str, ArenaSlab]:
        """The slabs a reply names, mapped (each once, kept by name), by the id its refs
        use; slabs the server has removed, or not named for a read lease's time, are
        unmapped."""
        now = self._clock()
        named: dict[str, ArenaSlab] = {}
        for slab in described:
            mapped = self._slabs.get(slab.name)
            if mapped is None:
                mapped = self._slabs[slab.name] = ArenaSlab(slab, now)
            mapped.named_at = now
            self._slab_idle_s = max(self._slab_idle_s, slab.lease_s)
            named[slab.lease_id] = mapped
        for name, mapped in list(self._slabs.items()):
            # one the server removed keeps its memory while mapped: let it go at once
            if mapped.named_at < now and (now - mapped.named_at > self._slab_idle_s
                                          or not (SHM_DIR / name).exists()):
                del self._slabs[name]
                mapped.close()
        return named

    def end_read(self, lease_id: str) -> Callable[[], None]:
        """What releases read lease ``lease_id`` (from any thread, once): the release is
        queued and told to the server in one call with the others queued, never waited
        on by the caller."""
        return _once_on_loop(self._queue_read_end, lease_id)

    def _queue_read_end(self, lease_id: str) -> None:
        self._reads_ending.append(lease_id)
        if len(self._reads_ending) == 1:  # the first queued: one call tells them all
            task = asyncio.ensure_future(self._tell_read_ends())
            self._returning.add(task)
            task.add_done_callback(self._returning.discard)

    async def _tell_read_ends(self) -> None:
        await asyncio.sleep(0)  # releases made in the same turn of the loop go together
        ending, self._reads_ending = self._reads_ending, []
        with contextlib.suppress(grpc.aio.UsageError):  # the client closed: they expire
            await self._end(ending)

    def forget(self) -> None:
        """The server no longer holds our leases (it restarted): drop them unreleased."""
        for segment in self._free:
            segment.close()
        self._free.clear()
        for slab in self._slabs.values():
            slab.close()
        self._slabs.clear()
        self._reads_ending.clear()

    async def close(self) -> None:
        segments, self._free = self._free, []
        await self.release(segments)
        ending, self._reads_ending = self._reads_ending, []
        await self._end(ending)
        for slab in self._slabs.values():
            slab.close()
        self._slabs.clear()


def _once_on_loop(callback: Callable[..., None], *args: Any) -> Callable[[], None]:
    """What runs ``callback(*args)`` on the running loop when first called, from any
    thread; later calls do nothing. Once the client closed it does nothing either: the
    server reaps the segment, or the read lease expires."""
    loop = asyncio.get_running_loop()
    pending = [True]

    def call() -> None:
        if not pending:
            return
        pending.clear()
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(callback, *args)

    return call


def round_up(size: int) -> int:
    """Lease sizes in whole MiB, so a session that grows a little still fits."""
    mib = 1 << 20
    return max(mib, -(-size // mib) * mib)
