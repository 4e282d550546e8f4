"""The host tier in shared memory: values in server-created slabs that same-host clients
map read-only and read in place, under a read lease that pins what they read.

Slabs are POSIX shared-memory segments the server creates as it creates its leases
(``create_segment``: a random name under ``PREFIX``, mode 0600,
``O_CREAT|O_EXCL|O_NOFOLLOW``, registered with ``multiprocessing``'s resource tracker, so a
crashed server's slabs are removed too). Allocation is memcached's: each slab is cut into
equal slots of one size class (a value's length rounded up by at most 1/16, 64 B at
least) with a free list; a value takes one slot. An engine's chunks are of one size per
layout, so one class serves a layout and a freed slot fits the next chunk exactly.

Slabs belong to one dedupe scope (``kvstore.format.keys.dedupe_scope``): a client maps
only slabs holding chunks of the scope it read, never another tenant's. A put does not
know its key's scope, so a value starts in an unscoped slab, which no client is ever
named; the first in-place read (``pin``) moves it into its scope's slabs (one copy, what
a reply segment costs) and later reads hand it out where it lies. A block key chains
from its scope, so a value's scope never changes.

Accounting: ``used_bytes`` is the length of every value held, plus those removed
(deleted, overwritten, evicted, expired) while pinned, whose slots are freed only once
the last pin goes; capacity bounds that. Real memory is the slabs (``slab_bytes``): a
new slab is made only while the slabs stay within ``capacity_bytes`` plus one slab per
size class and scope in use (slots round up, and a class's last slab has free slots),
else the put is ``TierFull``. Slabs are ``SLAB_BYTES`` (a sixteenth of a small tier's
capacity, a page at least); an empty one is unlinked at once. Free slots are taken
lowest first, so chunks placed together lie in order, evenly spaced.

A slot is reused only when nothing reads it: no pin, and nothing ``get`` or
``get_tensor`` handed out still alive (``Slot.read``: each holds a reference to the
slot's array, so its reference count tells, whichever thread dropped them).
"""

from __future__ import annotations

import contextlib
import heapq
import mmap
import os
import secrets
import sys
from multiprocessing import resource_tracker
from typing import ClassVar

import numpy as np
import torch

from kvstore.format.errors import ChunkNotFound, TierFull
from kvstore.format.shm_names import PREFIX, SHM_DIR
from kvstore.tiers.base import Buffer
from kvstore.tiers.host import HostTier

# slots of a class per slab: this many bytes' worth (one at least); a request's chunks
# (an engine's 4k-token prompt is tens of MiB) then mostly share one slab
SLAB_BYTES = 64 << 20
MIN_SLOT = 64
UNSCOPED = "\0unscoped"  # no dedupe scope is this: a value not read in place yet


def create_segment(size: int) -> tuple[str, mmap.mmap]:
    """A new shared-memory segment of ``size`` bytes only this user can open: (name,
    read-write mapping); the descriptor is closed, the mapping keeps the memory."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
        os.ftruncate(fd, size)
        segment = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.unlink(SHM_DIR / name)
        raise
    finally:
        os.close(fd)
    resource_tracker.register(f"/{name}", "shared_memory")
    return name, segment


def remove_segment(name: str, segment: mmap.mmap) -> None:
    """Unlink a segment ``create_segment`` made and unmap it (a view still alive keeps
    the mapping until it is dropped)."""
    with contextlib.suppress(BufferError):
        segment.close()
    with contextlib.suppress(FileNotFoundError):  # removed behind our back
        os.unlink(SHM_DIR / name)
    resource_tracker.unregister(f"/{name}", "shared_memory")


def fits_shared_memory(capacity_bytes: int) -> bool:
    """Whether /dev/shm has room for a tier of ``capacity_bytes`` and its slack: past its
    size a write into a slab would kill the process (SIGBUS), as a container's default
    64 MiB /dev/shm would."""
    room = os.statvfs(SHM_DIR)
    return capacity_bytes + 4 * SLAB_BYTES <= room.f_bavail * room.f_frsize


def slot_bytes(length: int) -> int:
    """The size class of a value of ``length`` bytes: rounded up by at most 1/16."""
    step = max(MIN_SLOT, 1 << max(0, length.bit_length() - 5))
    return max(MIN_SLOT, -(-length // step) * step)


def slab_size(slot_size: int, target: int) -> int:
    """Bytes of a slab of ``slot_size`` slots, about ``target`` of them: whole pages."""
    slots = max(1, target // slot_size)
    return -(-slots * slot_size // mmap.PAGESIZE) * mmap.PAGESIZE


class Slab:
    """One segment cut into ``slots`` slots of ``slot_bytes``, all of one ``scope``."""

    def __init__(self, scope: str, slot_size: int, size: int) -> None:
        self.scope = scope
        self.slot_bytes = slot_size
        self.size = size
        self.slots = size // slot_size
        self.slab_id = secrets.token_urlsafe(12)  # what refs name; not the file's name
        self.name, self.map = create_segment(self.size)
        self.array = np.frombuffer(self.map, dtype=np.uint8)  # (size,) the whole slab
        # a heap: the lowest free slot first, so chunks placed together lie in order,
        # evenly spaced (a reader takes them as one strided view)
        self.free = list(range(self.slots))
        self.taken: dict[int, Slot] = {}

    def close(self) -> None:
        del self.array  # the tier's own view: the mapping can close
        remove_segment(self.name, self.map)


class Slot:
    """Where one value lies: ``length`` bytes at ``offset`` of ``slab``. Everything
    handed out of it (the stored tensor, views, tensors or arrays made from those) is
    made from ``arr`` and keeps a reference to it, so the slot is read while ``arr`` has
    other references than the slot's own."""

    __slots__ = ("arr", "index", "length", "pins", "removed", "slab")

    def __init__(self, slab: Slab, index: int, length: int) -> None:
        self.slab = slab
        self.index = index
        self.length = length
        self.pins = 0
        self.removed = False  # no longer the value of its key: freed once unread
        self.arr = slab.array[self.offset : self.offset + length]  # (length,) uint8

    @property
    def offset(self) -> int:
        return self.index * self.slab.slot_bytes

    def read(self) -> bool:
        """Whether anything made from this slot is still alive (beyond ``arr`` itself:
        one reference, and the argument's)."""
        return sys.getrefcount(self.arr) > 2


class ArenaTier(HostTier):
    """``HostTier`` whose values live in shared-memory slabs (module docstring)."""

    name: ClassVar[str] = "host"

    def __init__(self, capacity_bytes: int, **kwargs) -> None:
        super().__init__(capacity_bytes, pin_memory=False, **kwargs)
        # a small tier's slabs are small, so the slack per class stays a small share
        self._slab_target = min(SLAB_BYTES, max(mmap.PAGESIZE, capacity_bytes // 16))
        self._slabs: dict[str, Slab] = {}
        self._open: dict[tuple[str, int], dict[str, Slab]] = {}  # slabs with a free slot
        self._slot_at: dict[int, Slot] = {}  # address of a stored value -> its slot
        self._lingering: set[Slot] = set()  # removed, still pinned or read
        self._pinned_removed = 0  # bytes of removed values still pinned

    @property
    def used_bytes(self) -> int:
        return self._used + self._pinned_removed

    @property
    def slab_bytes(self) -> int:
        """Shared memory the slabs take: the real memory of this tier."""
        return sum(slab.size for slab in self._slabs.values())

    # -- slots --

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return self._tensor(self._take_slot(UNSCOPED, nbytes))

    def _tensor(self, slot: Slot) -> torch.Tensor:
        self._slot_at[slot.slab.array.ctypes.data + slot.offset] = slot
        return torch.from_numpy(slot.arr)

    def _take_slot(self, scope: str, length: int) -> Slot:
        self._settle()
        size = slot_bytes(length)
        slabs = self._open.setdefault((scope, size), {})
        if not slabs:
            self._new_slab(scope, size)
        slab = next(iter(slabs.values()))
        index = heapq.heappop(slab.free)
        if not slab.free:
            del slabs[slab.slab_id]
        slot = Slot(slab, index, length)
        slab.taken[index] = slot
        return slot

    def _new_slab(self, scope: str, size: int) -> None:
        new = slab_size(size, self._slab_target)
        if self.slab_bytes + new > self._room(scope, size):
            self._purge_expired()
            self._settle()
        if self.slab_bytes + new > self._room(scope, size):
            raise TierFull(f"{self.name}: no free slot of {size} B and the slabs hold "
                           f"{self.slab_bytes} B of {self.capacity_bytes} B capacity")
        slab = Slab(scope, size, new)
        self._slabs[slab.slab_id] = slab
        self._open[(scope, size)][slab.slab_id] = slab

    def _room(self, scope: str, size: int) -> int:
        """What the slabs may take: capacity plus one slab of each class in use (its
        free slots), counting the class of ``size`` in ``scope``."""
        classes = {(slab.scope, slab.slot_bytes) for slab in self._slabs.values()}
        classes.add((scope, size))
        return self.capacity_bytes + sum(slab_size(c, self._slab_target) for _, c in classes)

    def _free_slot(self, slot: Slot) -> None:
        slab = slot.slab
        del slab.taken[slot.index]
        self._slot_at.pop(slab.array.ctypes.data + slot.offset, None)
        if not slab.taken:
            self._open[(slab.scope, slab.slot_bytes)].pop(slab.slab_id, None)
            del self._slabs[slab.slab_id]
            slab.close()
            return
        heapq.heappush(slab.free, slot.index)
        self._open[(slab.scope, slab.slot_bytes)][slab.slab_id] = slab

    def _let_go(self, slot: Slot) -> None:
        """``slot`` holds no key's value any more: free it, or once nothing reads it."""
        slot.removed = True
        if slot.pins:
            self._pinned_removed += slot.length
        if slot.pins or slot.read():
            self._lingering.add(slot)
        else:
            self._free_slot(slot)

    def _settle(self) -> None:
        """Free the removed slots nothing pins or reads any more."""
        if not self._lingering:
            return
        for slot in [s for s in self._lingering if not s.pins and not s.read()]:
            self._lingering.discard(slot)
            self._free_slot(slot)

    def _slot_of(self, stored: torch.Tensor) -> Slot | None:
        return self._slot_at.get(stored.data_ptr()) if stored.numel() else None

    # -- storage primitives (MemoryTier's, keeping slots in step) --

    def _store(self, key: str, stored: torch.Tensor, ttl_s: float | None) -> None:
        slot = self._slot_of(stored)
        old = self._values.get(key)
        old_slot = None if old is None else self._slot_of(old)
        del old  # the old value's tensor: not a reader of its slot
        try:
            super()._store(key, stored, ttl_s)
        except TierFull:
            if slot is not None:
                del stored  # the caller's reference goes with the failed put
                self._free_slot(slot)
            raise
        if old_slot is not None:
            self._let_go(old_slot)

    def _remove(self, key: str) -> int:
        stored = self._values.get(key)
        slot = None if stored is None else self._slot_of(stored)
        del stored
        freed = super()._remove(key)
        if slot is not None:
            self._let_go(slot)
        return freed

    def _view(self, key: str) -> Buffer:
        stored = self._lookup(key)
        slot = self._slot_of(stored)
        if slot is None:
            return super()._view(key)
        return slot.arr.data.toreadonly()  # keeps slot.arr referenced: the slot is read

    # -- pins: what same-host clients read in place --

    def pin_many(self, keys: list[str], scope: str) -> list[Slot | None]:
        """The slot of each key's value in ``scope``'s slabs, pinned until ``unpin``; a
        value not there yet is moved there first. None for one not held (or empty, or
        when no slot of the scope can be had)."""
        self._settle()
        return [self._pin(key, scope) for key in keys]

    def _pin(self, key: str, scope: str) -> Slot | None:
        try:
            stored = self._lookup(key)
        except ChunkNotFound:
            return None
        slot = self._slot_of(stored)
        del stored
        if slot is None or slot.slab.scope not in (scope, UNSCOPED):
            return None
        if slot.slab.scope != scope:
            try:
                moved = self._take_slot(scope, slot.length)
            except TierFull:
                return None
            moved.arr[:] = slot.arr
            self._values[key] = self._tensor(moved)
            self._proven.discard(key)  # a copy: proven again by its next reader
            self._let_go(slot)
            slot = moved
        slot.pins += 1
        return slot

    def unpin(self, slot: Slot) -> None:
        slot.pins -= 1
        if slot.removed and not slot.pins:
            self._pinned_removed -= slot.length
            self._settle()

    # -- what is held --

    async def held_bytes(self) -> int:
        """Bytes of the values the slabs hold for their keys (walked slot by slot: an
        accounting cross-check)."""
        return sum(slot.length for slab in self._slabs.values()
                   for slot in slab.taken.values() if not slot.removed)

    async def close(self) -> None:
        await super().close()
        for slab in self._slabs.values():
            slab.close()
        self._slabs.clear()
        self._open.clear()
        self._slot_at.clear()
        self._lingering.clear()
        self._pinned_removed = 0

