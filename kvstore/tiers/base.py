"""The one small interface every tier implements, and the metadata store interface.

A tier is a byte-capacity store of opaque values under string keys: encoded chunks
(see ``kvstore.format.chunk``) and window blobs. Tiers never evict on their own; the tier
manager picks victims through its policy and calls ``delete``. A put that does not fit
raises ``TierFull`` so the manager can evict and retry or place the value lower.
"""

from __future__ import annotations

import abc
import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvstore.format.chunk import Buffer
from kvstore.format.errors import KVTierError

# What a scan decodes or opens between turns it gives the event loop (whichever comes
# first): a store of 100k sessions is listed without holding the loop for seconds.
SCAN_PAGE = 256  # records (a small manifest decodes in ~20 us)
SCAN_PAGE_BYTES = 1 << 20  # record bytes (a 64k-token manifest is ~140 kB, ~200 us)


async def paced(records: Iterable[tuple[str, bytes]]) -> AsyncIterator[tuple[str, bytes]]:
    """``records`` (key, value) in order, yielding to the loop after each page of them."""
    count = size = 0
    for record in records:
        yield record
        count += 1
        size += len(record[1])
        if count == SCAN_PAGE or size >= SCAN_PAGE_BYTES:
            count = size = 0
            await asyncio.sleep(0)


@dataclass(frozen=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    items: int
    available: bool


class Tier(abc.ABC):
    """One medium. Accounting is exact: ``used_bytes`` is the sum of ``len(value)`` held."""

    name: ClassVar[str]
    # Only hbm and host may hold ephemeral (sliding-window) blobs; see DESIGN.md.
    holds_window: ClassVar[bool] = False
    # A durable tier survives a process restart (disk, object; redis with persistence).
    durable: bool = False  # per class; a fleet node makes its local tiers not durable
    # A shared tier is one medium for a whole fleet (metadata = "shared": redis, object):
    # it may hold keys other nodes wrote, which this node learns by asking it.
    shared: bool = False  # per class; set per node by the fleet's store

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        # Requests asking a remote medium whether it holds keys, by operation (EXISTS,
        # HEAD, LIST, GET of a chain pointer; "round trip" per Redis pipeline): what a
        # fleet's prefix lookups cost (kvstore.prefix.fleet_lookup), counted, not timed.
        self.probes: Counter[str] = Counter()

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int: ...

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)

    def medium_full(self) -> bool:
        """Whether the medium under this tier is full past what its own capacity says (a
        disk shared with other files, ``kvstore.tiers.disk.headroom``): a put refused there
        sheds every chunk retained in the tier (``TierStack.shed``), so what deletes left
        as cache gives the space back."""
        return False

    @abc.abstractmethod
    async def put(self, key: str, value: Buffer, *, ttl_s: float | None = None) -> None:
        """Store ``value`` whole under ``key`` (replacing any old value) or raise.

        Raises ``TierFull`` when it does not fit, ``TierUnavailable`` when the medium is
        unreachable. A reader never sees a partly written value.
        """

    @abc.abstractmethod
    async def get(self, key: str) -> Buffer:
        """Return the value, or raise ``ChunkNotFound`` / ``TierUnavailable``."""

    async def get_many(self, keys: Sequence[str]) -> list[Buffer | KVTierError]:
        """Each key's value, or the error its ``get`` raised (``ChunkNotFound``,
        ``TierUnavailable``, a ``CodecError``), in order; concurrent gets here, one
        batched read where a medium does better (the disk tier)."""
        async def one(key: str) -> Buffer | KVTierError:
            try:
                return await self.get(key)
            except KVTierError as exc:
                return exc

        return list(await asyncio.gather(*map(one, keys)))

    async def get_many_proven(self, keys: Sequence[str]
                              ) -> tuple[list[Buffer | KVTierError], list[bool]]:
        """``get_many``, and per key whether this tier proved that the bytes have the
        digest their block key states, so a reader need not hash them again (the disk
        tier's admitted records); a tier that proves nothing says False for each."""
        return await self.get_many(keys), [False] * len(keys)

    def note_proven(self, key: str, value: Buffer) -> None:  # noqa: B027 - optional hook
        """A reader hashed ``value``, this tier's answer for ``key``, and found the digest
        the block key states: a tier whose stored bytes cannot change under a reader may
        remember it and say so in ``get_many_proven`` (the memory tiers)."""

    @abc.abstractmethod
    async def delete(self, key: str) -> int:
        """Remove ``key``; return the bytes freed (0 when it was absent)."""

    @abc.abstractmethod
    async def contains(self, key: str) -> bool: ...

    @abc.abstractmethod
    def keys(self) -> AsyncIterator[str]:
        """Every key held, in no particular order."""

    async def ttl_s(self, key: str) -> float | None:
        """Time left before ``key`` expires; None when it has no TTL (or the medium keeps
        none: it then never expires a value itself)."""
        return None

    async def find_chains(self, chains: Sequence[str]) -> list[str | None] | None:
        """The block key (``kvstore.format.keys``) this medium holds for each chain key, None
        where it holds none; None for a tier that cannot be asked by chain key (only a
        fleet's shared tiers can: ``kvstore.prefix.fleet_lookup``)."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing
        """Release connections and file handles."""

    async def stats(self) -> TierStats:
        return TierStats(self.name, self.capacity_bytes, self.used_bytes, await self.count(), True)

    async def count(self) -> int:
        return sum([1 async for _ in self.keys()])


# MetaStore key prefixes of derived records: reference counts (recounted from the manifests
# by a repair) and retention marks (``kvstore.prefix.chains.mark``; without them every
# unreferenced chunk is retained). A durable store need not log either.
REF_PREFIX = "ref/"
RETAIN_PREFIX = "ret/"
DERIVED_PREFIXES = (REF_PREFIX, RETAIN_PREFIX)
# A fleet node's own MetaStore names the bucket its manifests live in (a logged record: a
# repair of its directory finds it, and recounts the references from that bucket).
FLEET_BUCKET_KEY = "fleet/bucket"


class MetaStore(abc.ABC):
    """Small durable records (session manifests, reference counts) with atomic batches."""

    # The node whose manifests this store writes, where several nodes share the
    # manifests (kvstore.fleet.shared_meta); "" where one node owns them. node_address:
    # where other nodes and routers reach it (recorded in its manifests beside node_id).
    node_id: str = ""
    node_address: str = ""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    async def commit(self, writes: dict[str, bytes | None]) -> None:
        """Apply every write atomically; ``None`` deletes the key."""

    @abc.abstractmethod
    async def scan(self, prefix: str) -> list[tuple[str, bytes]]:
        """All records whose key starts with ``prefix``, sorted by key."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release handles."""


class MemoryMetaStore(MetaStore):
    """Non-durable metadata, for tests and for a store configured without a disk tier."""

    def __init__(self) -> None:
        self._records: dict[str, bytes] = {}
        self._lock = asyncio.Lock()

    async def get(self, key: str) -> bytes | None:
        return self._records.get(key)

    async def commit(self, writes: dict[str, bytes | None]) -> None:
        async with self._lock:
            for key, value in writes.items():
                if value is None:
                    self._records.pop(key, None)
                else:
                    self._records[key] = bytes(value)

    async def scan(self, prefix: str) -> list[tuple[str, bytes]]:
        return sorted((k, v) for k, v in self._records.items() if k.startswith(prefix))
