"""Tiers and a MetaStore that seal every value they are given (``kvstore.encryption.seal``).

``EncryptedTier(inner, keyring, domains)`` wraps a tier whose medium leaves the process
(redis, disk, object). The manager moves blocks between tiers without session context
(eviction host -> disk, demotion disk -> object), so the dedupe domain a block is sealed
for comes from ``BlockDomains``: claimed by the spill that brought the block in (its
chain key proves the domain, ``kvstore.format.keys``), or learned from the header of a sealed
copy read back. A block whose domain is unknown is never written in clear: the put
fails for that key alone, as a medium refusing it would.

``EncryptedMetaStore`` seals session manifests (token ids and the tail are user data)
under their tenant's key, bound to the record key (``RecordSealer``, which a fleet's
``SharedMetaStore`` applies to the manifests it keeps in the bucket). Reference counts,
demotion and quarantine notes hold no user data and stay in clear.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from kvstore.encryption.seal import MAGIC, OVERHEAD_BYTES, Keyring
from kvstore.format.errors import ChunkCorrupt, TierUnavailable
from kvstore.format.keys import dedupe_scope
from kvstore.session.manifest import MANIFEST_PREFIX
from kvstore.tiers.base import Buffer, MetaStore, Tier, TierStats, paced

# Values up to this size are sealed and opened on the event loop: a thread hop would
# cost more than AES-GCM of a few KiB.
INLINE_BYTES = 64 << 10
log = logging.getLogger(__name__)


class BlockDomain(NamedTuple):
    scope: str  # kvstore.format.keys.dedupe_scope
    layout_hash: int


class BlockDomains:
    """Block key -> the domain and layout it is sealed for, for blocks in flight between
    tiers. ``sweep`` drops the blocks nothing references any more."""

    def __init__(self) -> None:
        self._by_key: dict[str, BlockDomain] = {}
        self._swept_at = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str) -> BlockDomain | None:
        return self._by_key.get(key)

    def claim(self, key: str, domain: BlockDomain) -> None:
        self._by_key[key] = domain

    def sweep(self, keep: Callable[[str], bool], *, floor: int = 4096) -> None:
        """Forget blocks ``keep`` rejects, once the map has doubled since the last sweep
        (amortised O(1) per claim)."""
        if len(self._by_key) < max(floor, 2 * self._swept_at):
            return
        self._by_key = {k: v for k, v in self._by_key.items() if keep(k)}
        self._swept_at = len(self._by_key)


async def _run(function: Callable, size: int, *args: object):
    return function(*args) if size <= INLINE_BYTES else await asyncio.to_thread(function, *args)


class EncryptedTier(Tier):
    """``inner`` with every value sealed; name, durability and the rest are the inner's."""

    def __init__(self, inner: Tier, keyring: Keyring, domains: BlockDomains) -> None:
        super().__init__(inner.capacity_bytes)
        self.inner = inner
        self.keyring = keyring
        self.domains = domains
        self.name = inner.name  # type: ignore[misc]  # the ClassVar, per instance here
        self.durable = inner.durable
        self.holds_window = inner.holds_window  # type: ignore[misc]

    def __getattr__(self, attr: str):
        # The inner tier's own extras (the disk tier's meta, health, resync) stay in reach.
        return getattr(self.inner, attr)

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    @property
    def free_bytes(self) -> int:
        # The manager makes room for the plaintext's size; the sealed value is larger.
        return max(0, self.inner.free_bytes - OVERHEAD_BYTES)

    def medium_full(self) -> bool:
        return self.inner.medium_full()

    async def put(self, key: str, value: Buffer, *, ttl_s: float | None = None) -> None:
        domain = self.domains.get(key)
        if domain is None:
            log.error("tier %s: no dedupe domain known for %s; not writing it", self.name, key)
            raise TierUnavailable(f"{self.name}: the dedupe domain of {key} is unknown, so "
                                  "it cannot be sealed", whole_tier=False)
        sealed = await _run(self.keyring.seal, len(value), key, domain.scope, value,
                            domain.layout_hash)
        await self.inner.put(key, sealed, ttl_s=ttl_s)

    async def get(self, key: str) -> Buffer:
        sealed = await self.inner.get(key)
        header, plaintext = await _run(self.keyring.open, len(sealed), key, sealed)
        known = self.domains.get(key)
        found = BlockDomain(header.domain, header.layout_hash)
        if known is not None and known != found:
            raise ChunkCorrupt(f"{self.name}: {key} is sealed for another domain or layout")
        if known is None:
            self.domains.claim(key, found)  # a move out of here reseals it the same way
        return plaintext

    async def delete(self, key: str) -> int:
        return await self.inner.delete(key)

    async def ttl_s(self, key: str) -> float | None:
        return await self.inner.ttl_s(key)

    async def contains(self, key: str) -> bool:
        return await self.inner.contains(key)

    def keys(self) -> AsyncIterator[str]:
        return self.inner.keys()

    async def count(self) -> int:
        return await self.inner.count()

    async def stats(self) -> TierStats:
        return await self.inner.stats()

    async def close(self) -> None:
        await self.inner.close()


class RecordSealer:
    """Manifest records sealed under their tenant's key, bound to their record key; every
    other record (reference counts, notes, layouts) passes in clear."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring

    @staticmethod
    def domain(key: str) -> str | None:
        """The tenant domain a record is sealed for; None for records left in clear."""
        if not key.startswith(MANIFEST_PREFIX):
            return None
        return dedupe_scope(key[len(MANIFEST_PREFIX):].partition("/")[0])

    def seal(self, key: str, value: bytes) -> bytes:
        domain = self.domain(key)
        return value if domain is None else self.keyring.seal(key, domain, value)

    def open(self, key: str, value: bytes) -> bytes:
        """The plaintext of ``value``; ``ChunkCorrupt`` for a record sealed for another
        tenant, under a key not held, altered, or never sealed."""
        domain = self.domain(key)
        if domain is None:
            return value
        header, plaintext = self.keyring.open(key, value)
        if header.domain != domain:
            raise ChunkCorrupt(f"record {key!r} is sealed for another tenant")
        return plaintext


def opened_record(key: str, value: bytes, keyring: Keyring | None) -> bytes:
    """A metadata record as an offline reader finds it (a directory or bucket may hold
    records in clear beside sealed ones): opened when sealed and ``keyring`` is given."""
    if keyring is None or not value.startswith(MAGIC):
        return value
    return RecordSealer(keyring).open(key, value)


class EncryptedMetaStore(MetaStore):
    """``inner`` with manifests sealed (``RecordSealer``)."""

    def __init__(self, inner: MetaStore, keyring: Keyring) -> None:
        self.inner = inner
        self.sealer = RecordSealer(keyring)

    def __getattr__(self, attr: str):
        return getattr(self.inner, attr)

    async def get(self, key: str) -> bytes | None:
        value = await self.inner.get(key)
        return None if value is None else self.sealer.open(key, value)

    async def commit(self, writes: dict[str, bytes | None]) -> None:
        await self.inner.commit({key: value if value is None else self.sealer.seal(key, value)
                                 for key, value in writes.items()})

    async def scan(self, prefix: str) -> list[tuple[str, bytes]]:
        out = []
        async for key, value in paced(await self.inner.scan(prefix)):
            try:
                out.append((key, self.sealer.open(key, value)))
            except ChunkCorrupt as exc:
                # kept as stored: a reader decoding it finds it corrupt and says which
                log.error("meta record %s cannot be opened: %s", key, exc)
                out.append((key, value))
        return out

    async def close(self) -> None:
        await self.inner.close()
