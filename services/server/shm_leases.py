"""Same-host fast path, server side: the segments the server creates and leases.

The server never opens a name a client sent. It creates every segment itself (a random
name under ``kvtier.shm.PREFIX``, mode 0600, ``O_CREAT|O_EXCL|O_NOFOLLOW``), keeps the
mapping, and leases it to one connection (``peer``): clients refer to it only by the
random lease id, looked up in this table, so a name, a path, ``.`` or ``..`` from a
client never reaches the filesystem.

- Spill: ``LeaseSegment`` -> ``create``; each payload ref -> ``read`` (bounds checked,
  copied out before the call answers).
- Restore/Resume: ``reply_segment`` reuses the caller's offered lease when the session
  fits, else leases a new one; ``done`` when the stream ends.
- ReadChunks in place: ``pin_reads`` makes a read lease over host-tier slots
  (``kvstore.tiers.arena``) the caller pinned; the slots are unpinned when the client
  releases it (``release``, the same ReleaseSegments) or it expires (``reap``).

Each use renews a lease for ``lease_s``; ``reap`` unlinks those unused that long and
``close`` all of them (shutdown). Each segment is also registered with
``multiprocessing``'s resource tracker, so a crashed server's segments are removed too.
Bounds: bytes per peer and in all, and a fixed number of leases per peer and in all
(each is a mapping, or pinned memory): ``SharedMemoryExhausted`` (RESOURCE_EXHAUSTED)
naming the bound; restores then send their bytes inline, in-place reads through the
reply segment.
"""

from __future__ import annotations

import mmap
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.format.errors import InvalidRequest, SharedMemoryExhausted, SharedMemoryUnavailable
from kvstore.tiers.arena import Slot, create_segment, remove_segment
from kvtier.shm import round_up
from proto import kvtier_pb2 as pb

MAX_LEASES_PER_CLIENT = 64
MAX_LEASES_TOTAL = 1024


@dataclass(eq=False)
class Lease:
    lease_id: str
    peer: str
    name: str
    size: int
    deadline: float
    map: mmap.mmap = field(repr=False)
    busy: bool = False  # a restore is writing into it: not reaped, not reused
    doomed: bool = False  # released while busy: unlinked once the write ends


@dataclass(eq=False)
class ReadLease:
    """Host-tier slots pinned for one in-place read: unpinned on release or expiry."""

    lease_id: str
    peer: str
    size: int
    deadline: float
    slots: list[Slot] = field(repr=False)
    unpin: Callable[[Slot], None] = field(repr=False)


class LeaseTable:
    def __init__(self, lease_s: float, per_client_bytes: int, total_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.per_client_bytes = per_client_bytes
        self.total_bytes = total_bytes
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._reads: dict[str, ReadLease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self):
        return iter(list(self._leases.values()))

    @property
    def held_bytes(self) -> int:
        """Segment bytes leased and host-tier bytes pinned by read leases."""
        return sum(lease.size for lease in self._leases.values()) + \
            sum(read.size for read in self._reads.values())

    def held_by(self, peer: str) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.peer == peer]

    def create(self, peer: str, size: int) -> Lease:
        if size < 1:
            raise InvalidRequest("a shared memory lease needs a size of at least 1 B")
        self.reap()
        size = round_up(size)
        self._check_bounds(peer, size, "lease")
        name, segment = create_segment(size)
        lease = Lease(secrets.token_urlsafe(18), peer, name, size,
                      self.clock() + self.lease_s, segment)
        self._leases[lease.lease_id] = lease
        return lease

    def _check_bounds(self, peer: str, size: int, what: str) -> None:
        """Refuse ``size`` more bytes (and one more lease) for ``peer`` past a bound,
        naming it; read leases count with segment leases."""
        mine = self.held_by(peer)
        reads = [read for read in self._reads.values() if read.peer == peer]
        held = sum(lease.size for lease in mine) + sum(read.size for read in reads)
        if held + size > self.per_client_bytes:
            raise SharedMemoryExhausted(f"a {size} B shared memory {what} would exceed "
                                        f"shm_lease_bytes_per_client ({self.per_client_bytes} B; "
                                        f"this client holds {held} B): send bytes inline")
        if self.held_bytes + size > self.total_bytes:
            raise SharedMemoryExhausted(f"a {size} B shared memory {what} would exceed "
                                        f"shm_lease_bytes_total ({self.total_bytes} B; "
                                        f"{self.held_bytes} B are leased): send bytes inline")
        if len(mine) + len(reads) >= MAX_LEASES_PER_CLIENT or \
                len(self) + len(self._reads) >= MAX_LEASES_TOTAL:
            raise SharedMemoryExhausted(
                f"shared memory leases are capped at {MAX_LEASES_PER_CLIENT} per client and "
                f"{MAX_LEASES_TOTAL} in all: release some")

    def pin_reads(self, peer: str, slots: list[Slot], unpin: Callable[[Slot], None]
                  ) -> ReadLease:
        """A read lease of ``peer`` over ``slots`` (pinned by the caller), which ``unpin``
        lets go of on release or expiry; past a bound ``SharedMemoryExhausted`` (the
        caller unpins them then)."""
        self.reap()
        size = sum(slot.length for slot in slots)
        self._check_bounds(peer, size, "read lease")
        read = ReadLease(secrets.token_urlsafe(18), peer, size, self.clock() + self.lease_s,
                         slots, unpin)
        self._reads[read.lease_id] = read
        return read

    @property
    def reads(self) -> int:
        """Read leases held."""
        return len(self._reads)

    def _end_read(self, read: ReadLease) -> None:
        del self._reads[read.lease_id]
        for slot in read.slots:
            read.unpin(slot)

    def describe(self, lease: Lease) -> pb.SharedMemoryLease:
        """What the client needs to map it: the name travels only server -> client."""
        return pb.SharedMemoryLease(lease_id=lease.lease_id, name=lease.name, size=lease.size,
                                    lease_s=self.lease_s)

    def resolve(self, peer: str, lease_id: str) -> Lease:
        """The caller's live lease ``lease_id``; anything else is INVALID_ARGUMENT."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.deadline <= self.clock() and not lease.busy:
            self._release(lease)
            lease = None
        if lease is None or lease.peer != peer or lease.doomed:
            # One answer for unknown, expired and another client's: nothing to probe.
            raise SharedMemoryUnavailable(
                f"shared memory lease {lease_id[:64]!r} is not held by this client: unknown, "
                f"released, or unused for shm_lease_s ({self.lease_s:g} s)")
        return lease

    def read(self, peer: str, ref: pb.SharedMemoryRef, max_length: int) -> bytes:
        """A copy of the referenced bytes of the caller's segment (Spill payloads)."""
        lease = self.resolve(peer, ref.lease_id)
        if ref.length > max_length:
            raise InvalidRequest(f"shared memory payload of {ref.length} B exceeds the "
                                 f"{max_length} B left to this Spill (max_spill_bytes)")
        if ref.offset + ref.length > lease.size:
            raise InvalidRequest(f"shared memory ref [{ref.offset}:{ref.offset + ref.length}]"
                                 f" is beyond the leased segment's {lease.size} B")
        lease.deadline = self.clock() + self.lease_s
        return lease.map[ref.offset : ref.offset + ref.length]

    def reply_segment(self, peer: str, offered: str, size: int) -> Lease | None:
        """The lease a restore of ``size`` bytes writes into, marked busy until ``done``:
        ``offered`` (a lease of the caller's) when it fits, else a new one (``offered``,
        too small, is released first). None when nothing is to be written."""
        if offered:
            lease = self.resolve(peer, offered)
            if lease.busy:
                raise InvalidRequest(f"shared memory lease {offered!r} is in use by "
                                     "another call of this client")
            if size <= lease.size:
                lease.busy = True
                return lease
            self._release(lease)
        if not size:
            return None
        lease = self.create(peer, size)
        lease.busy = True
        return lease

    def done(self, lease: Lease) -> None:
        lease.busy = False
        lease.deadline = self.clock() + self.lease_s
        if lease.doomed:
            self._release(lease)

    def release(self, peer: str, lease_ids) -> int:
        """End the caller's leases among ``lease_ids``; others are ignored."""
        released = 0
        for lease_id in lease_ids:
            read = self._reads.get(lease_id)
            if read is not None and read.peer == peer:
                self._end_read(read)
                released += 1
                continue
            lease = self._leases.get(lease_id)
            if lease is None or lease.peer != peer or lease.doomed:
                continue
            released += 1
            if lease.busy:
                lease.doomed = True
            else:
                self._release(lease)
        return released

    def reap(self) -> int:
        """Unlink the leases unused for ``lease_s`` and end the read leases that old;
        how many."""
        now = self.clock()
        expired = [lease for lease in self._leases.values()
                   if lease.deadline <= now and not lease.busy]
        for lease in expired:
            self._release(lease)
        ended = [read for read in self._reads.values() if read.deadline <= now]
        for read in ended:
            self._end_read(read)
        return len(expired) + len(ended)

    def close(self) -> None:
        for lease in list(self._leases.values()):
            self._release(lease)
        for read in list(self._reads.values()):
            self._end_read(read)

    def _release(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        remove_segment(lease.name, lease.map)
