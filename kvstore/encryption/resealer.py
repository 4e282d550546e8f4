"""A serving node reseals its own media under its keyring's current key.

``kvtier rekey`` rewrites what servers share (Redis, a fleet's bucket) beside them. A
node's disk tier, its own object tier and its local manifests belong to its one server
(the writer of the segments, the keeper of the accounting), so that server reseals them
itself, in the background, whenever its keyring holds a key other than ``current``: at
start and after a reload (``services.server.reload``).

Each value is rewritten under the store's lock of its key (chunk and window copies: no
free, drop or eviction of that key interleaves, so a freed value is never brought back)
and each manifest under its session's write lock (no spill, delete or demotion commits
meanwhile, so a newer generation is never overwritten). The rules are the offline
rekey's (``kvstore.encryption.rekey``): the same storage key, domain and layout, the
copy read back and checked under ``current``; a value that does not open is left as it
is and reported. The sealing runs off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

from kvstore.encryption.rekey import RekeyReport, remaining_ttl, reseal, verify
from kvstore.encryption.seal import MAGIC, Keyring, read_header
from kvstore.encryption.tiers import EncryptedMetaStore, EncryptedTier
from kvstore.format.errors import ChunkCorrupt, ChunkNotFound
from kvstore.session.catalog import Catalog
from kvstore.session.manifest import MANIFEST_PREFIX
from kvstore.tiers.base import Buffer, MetaStore

log = logging.getLogger(__name__)


def _sealed_under(value: Buffer) -> str | None:
    """The key id sealing ``value``, or None for a value stored in clear."""
    if bytes(memoryview(value).cast("B")[:len(MAGIC)]) != MAGIC:
        return None
    return read_header(value).key_id


class Resealer:
    """Reseals ``tiers`` (the stack's encrypting tiers named in ``own``) and, when they are
    this node's (an ``EncryptedMetaStore``), the manifests of ``meta``."""

    def __init__(self, tiers: Collection[object], meta: MetaStore, catalog: Catalog,
                 locks, own: Collection[str]) -> None:
        self.tiers = [t for t in tiers if isinstance(t, EncryptedTier) and t.name in own]
        self.meta = meta if isinstance(meta, EncryptedMetaStore) else None
        self.catalog, self.locks = catalog, locks
        self.last: RekeyReport | None = None  # the last finished pass

    def needed(self, keyring: Keyring) -> bool:
        """Whether a pass may find anything: the keyring holds a key besides ``current``."""
        return bool(self.tiers or self.meta) and keyring.key_ids != [keyring.current]

    async def run(self, keyring: Keyring) -> RekeyReport:
        report = RekeyReport(keyring.current, keyring.key_ids)
        for tier in self.tiers:
            report.places.append(tier.name)
            async for key in tier.inner.keys():
                async with self.locks.hold(key):
                    await self._value(tier, key, keyring, report)
        if self.meta is not None:
            report.places.append("manifests")
            for key, _ in await self.meta.inner.scan(MANIFEST_PREFIX):
                tenant, _, session_id = key.removeprefix(MANIFEST_PREFIX).partition("/")
                async with self.catalog.write(tenant, session_id):
                    await self._record(key, keyring, report)
        self.last = report
        log.info("reseal under %s: %d resealed, %d already current, %d in clear, %d do "
                 "not open, %d still under other keys", report.current, report.resealed,
                 report.already_current, report.in_clear, len(report.unreadable),
                 report.sealed_under_old)
        return report

    async def _value(self, tier: EncryptedTier, key: str, keyring: Keyring,
                     report: RekeyReport) -> None:
        try:
            sealed = await tier.inner.get(key)
        except ChunkNotFound:
            return  # freed or evicted since the listing
        fresh = await self._resealed(keyring, key, sealed, report)
        if fresh is None:
            return
        await tier.inner.put(key, fresh[0], ttl_s=await remaining_ttl(tier.inner, key))
        try:
            back = await tier.inner.get(key)
        except ChunkNotFound:
            return  # evicted at once by the medium (a TTL): nothing is left under either
        await asyncio.to_thread(verify, keyring, key, back, fresh[1])
        report.resealed += 1

    async def _record(self, key: str, keyring: Keyring, report: RekeyReport) -> None:
        stored = await self.meta.inner.get(key)
        if stored is None:
            return  # deleted since the listing
        fresh = await self._resealed(keyring, key, stored, report)
        if fresh is None:
            return
        await self.meta.inner.commit({key: fresh[0]})
        back = await self.meta.inner.get(key)
        if back is not None:
            await asyncio.to_thread(verify, keyring, key, back, fresh[1])
            report.resealed += 1

    @staticmethod
    async def _resealed(keyring: Keyring, key: str, stored: Buffer, report: RekeyReport
                        ) -> tuple[bytes, bytes] | None:
        """(the value under ``current``, its plaintext), or None when it stays as it is
        (counted: in clear, already current, or not opening, which keeps its key counted)."""
        key_id = _sealed_under(stored)
        if key_id is None:
            report.in_clear += 1
            return None
        try:
            fresh = await asyncio.to_thread(reseal, keyring, key, stored)
        except ChunkCorrupt:
            report.unreadable.append(key)
            report.note(key_id)
            return None
        if fresh is None:
            report.already_current += 1
        return fresh
