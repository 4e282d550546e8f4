"""In-process memory tiers: values held as 1-D uint8 torch tensors on one device.

``MemoryTier`` is the shared machinery; ``HostTier`` keeps values in host RAM (pinned
when CUDA is present, so promotion to HBM is a DMA without a staging copy) and
``kvstore.tiers.hbm.HBMTier`` keeps them on the serving device.

Values are immutable once stored: ``get`` hands out a read-only view of the stored bytes
(no copy) when they live in host memory, and ``put`` always copies the caller's buffer.
So once a reader has hashed a stored value and found its block key's digest
(``note_proven``), it stays proven until that key is stored again or removed, and later
reads need not hash it again (``get_many_proven``).
A view keeps its tensor alive after a delete or overwrite until the reader drops it; that
memory is outside the accounting, which counts what the tier holds.
TTLs are honoured lazily: an expired value is dropped when it is next looked up or when
room is needed, and until then it is still counted, because it is still held.
"""

from __future__ import annotations

import heapq
import time
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from typing import ClassVar

import numpy as np
import torch

from kvstore.format.errors import ChunkNotFound, InvalidRequest, KVTierError, TierFull
from kvstore.tiers.base import Buffer, Tier
from kvstore.tiers.common import as_byte_view, check_key


class MemoryTier(Tier):
    """A dict of key -> 1-D uint8 tensor on ``device`` with exact byte accounting."""

    name: ClassVar[str] = "memory"
    holds_window: ClassVar[bool] = True

    def __init__(self, capacity_bytes: int, *, device: torch.device, pin_memory: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(capacity_bytes)
        self.clock = clock  # seconds that TTL deadlines are set and judged by
        self.device = device
        self.pin_memory = pin_memory
        self._values: dict[str, torch.Tensor] = {}  # each (nbytes,) uint8 on self.device
        self._proven: set[str] = set()  # keys whose stored bytes a reader found intact
        self._used = 0
        self._expiry: dict[str, float] = {}
        self._expiry_heap: list[tuple[float, str]] = []

    @property
    def used_bytes(self) -> int:
        return self._used

    # -- storage primitives (synchronous: each call is atomic for asyncio callers) --

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device,
                           pin_memory=self.pin_memory)

    def _copy_in(self, view: memoryview) -> torch.Tensor:
        stored = self._allocate(len(view))
        if len(view) == 0:
            return stored
        if stored.device.type == "cpu":
            # numpy's view of the tensor accepts a buffer assignment: one memcpy, no warning
            # about read-only sources (bytes) as torch.frombuffer would give.
            stored.numpy().data[:] = view
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only source is fine
                source = torch.frombuffer(view, dtype=torch.uint8)
            stored.copy_(source)
        return stored

    def _store(self, key: str, stored: torch.Tensor, ttl_s: float | None) -> None:
        nbytes = stored.numel()
        old = self._values.get(key)
        old_bytes = 0 if old is None else old.numel()
        if self._used - old_bytes + nbytes > self.capacity_bytes:
            self._purge_expired()
            old = self._values.get(key)
            old_bytes = 0 if old is None else old.numel()
        if self._used - old_bytes + nbytes > self.capacity_bytes:
            raise TierFull(
                f"{self.name}: {nbytes} B does not fit ({self.free_bytes} B free of "
                f"{self.capacity_bytes} B)"
            )
        self._values[key] = stored
        self._proven.discard(key)
        self._used += nbytes - old_bytes
        if ttl_s is None:
            self._expiry.pop(key, None)
        else:
            deadline = self.clock() + ttl_s
            self._expiry[key] = deadline
            heapq.heappush(self._expiry_heap, (deadline, key))

    def _lookup(self, key: str) -> torch.Tensor:
        stored = self._values.get(key)
        if stored is None:
            raise ChunkNotFound(f"{self.name}: no value under {key!r}")
        deadline = self._expiry.get(key)
        if deadline is not None and deadline <= self.clock():
            self._remove(key)
            raise ChunkNotFound(f"{self.name}: value under {key!r} expired")
        return stored

    def _remove(self, key: str) -> int:
        stored = self._values.pop(key, None)
        self._expiry.pop(key, None)
        self._proven.discard(key)
        if stored is None:
            return 0
        self._used -= stored.numel()
        return stored.numel()

    def _purge_expired(self) -> int:
        now = self.clock()
        freed = 0
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            deadline, key = heapq.heappop(self._expiry_heap)
            if self._expiry.get(key) == deadline:  # not refreshed or removed since
                freed += self._remove(key)
        return freed

    # -- Tier interface --

    async def put(self, key: str, value: Buffer, *, ttl_s: float | None = None) -> None:
        check_key(key)
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidRequest(f"ttl_s must be > 0, got {ttl_s}")
        view = as_byte_view(value)
        self._store(key, self._copy_in(view), ttl_s)

    async def put_tensor(self, key: str, tensor: torch.Tensor, *, ttl_s: float | None = None
                         ) -> None:
        """Store a copy of ``tensor``: (nbytes,) uint8, contiguous, on any device."""
        check_key(key)
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise InvalidRequest(
                f"put_tensor takes a (nbytes,) uint8 tensor, got {tuple(tensor.shape)} "
                f"{tensor.dtype}"
            )
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidRequest(f"ttl_s must be > 0, got {ttl_s}")
        stored = self._allocate(tensor.numel())
        stored.copy_(tensor)
        self._store(key, stored, ttl_s)

    async def get(self, key: str) -> Buffer:
        """A read-only view of the stored bytes (a copy to host when they live on a GPU)."""
        return self._view(key)

    def _view(self, key: str) -> Buffer:
        stored = self._lookup(key)
        if stored.device.type != "cpu":
            stored = stored.cpu()
        return stored.numpy().data.toreadonly()

    async def get_many_proven(self, keys: Sequence[str]
                              ) -> tuple[list[Buffer | KVTierError], list[bool]]:
        # no suspension: each value and its flag are read in one step of the loop
        values: list[Buffer | KVTierError] = []
        flags: list[bool] = []
        for key in keys:
            try:
                values.append(self._view(key))
                flags.append(key in self._proven)
            except KVTierError as exc:
                values.append(exc)
                flags.append(False)
        return values, flags

    def note_proven(self, key: str, value: Buffer) -> None:
        stored = self._values.get(key)
        if stored is None or stored.device.type != "cpu" or len(value) != stored.numel():
            return
        # Only the very bytes stored (a view ``get`` handed out), not a copy of them.
        if stored.numel() and np.frombuffer(value, np.uint8).ctypes.data == stored.data_ptr():
            self._proven.add(key)

    async def get_tensor(self, key: str) -> torch.Tensor:
        """The stored (nbytes,) uint8 tensor itself, on ``self.device``: read it, never write it."""
        return self._lookup(key)

    async def delete(self, key: str) -> int:
        return self._remove(key)

    async def ttl_s(self, key: str) -> float | None:
        self._lookup(key)
        deadline = self._expiry.get(key)
        return None if deadline is None else max(0.001, deadline - self.clock())

    async def contains(self, key: str) -> bool:
        try:
            self._lookup(key)
        except ChunkNotFound:
            return False
        return True

    async def keys(self) -> AsyncIterator[str]:
        self._purge_expired()
        for key in list(self._values):
            yield key

    async def count(self) -> int:
        self._purge_expired()
        return len(self._values)

    async def held_bytes(self) -> int:
        """Bytes really held by the stored tensors (an accounting cross-check)."""
        return sum(t.untyped_storage().nbytes() for t in self._values.values())

    async def close(self) -> None:
        self._values.clear()
        self._expiry.clear()
        self._expiry_heap.clear()
        self._used = 0


class HostTier(MemoryTier):
    """Host RAM; pinned when CUDA is present so copies to the device can be asynchronous."""

    name: ClassVar[str] = "host"

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        super().__init__(capacity_bytes, device=torch.device("cpu"), pin_memory=pin_memory,
                         clock=clock)
