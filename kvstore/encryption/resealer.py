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

import logging
from collections.abc import Collection
from contextlib import AbstractAsyncContextManager

from kvstore.encryption.rekey import RekeyReport, rekey_records, rekey_tier
from kvstore.encryption.seal import Keyring
from kvstore.encryption.tiers import EncryptedMetaStore, EncryptedTier
from kvstore.placement.locks import KeyedLocks
from kvstore.session.catalog import Catalog
from kvstore.session.manifest import MANIFEST_PREFIX
from kvstore.tiers.base import MetaStore, Tier

log = logging.getLogger(__name__)


class Resealer:
    """Reseals ``tiers`` (the stack's encrypting tiers named in ``own``) and, when they are
    this node's (an ``EncryptedMetaStore``), the manifests of ``meta``."""

    def __init__(self, tiers: Collection[Tier], meta: MetaStore, catalog: Catalog,
                 locks: KeyedLocks, own: Collection[str]) -> None:
        self.tiers = [t for t in tiers if isinstance(t, EncryptedTier) and t.name in own]
        self.meta = meta if isinstance(meta, EncryptedMetaStore) else None
        self.catalog, self.locks = catalog, locks

    def keyring(self) -> Keyring | None:
        """The keyring the node's encrypting tiers seal with (a reload changes it in
        place), or None when it encrypts nothing this resealer covers."""
        return self.tiers[0].keyring if self.tiers else (
            self.meta.sealer.keyring if self.meta is not None else None)

    def needed(self, keyring: Keyring) -> bool:
        """Whether a pass may find anything: the keyring holds a key besides ``current``."""
        return bool(self.tiers or self.meta) and keyring.key_ids != [keyring.current]

    async def run(self, keyring: Keyring) -> RekeyReport:
        report = RekeyReport(keyring.current, keyring.key_ids)
        for tier in self.tiers:
            await rekey_tier(tier.inner, keyring, report, hold=self.locks.hold)
        if self.meta is not None:
            await rekey_records(self.meta.inner, keyring, report, "manifests",
                                hold=self._session_of)
        log.info("reseal under %s: %d resealed, %d already current, %d in clear, %d do "
                 "not open (left as they are)", report.current, report.resealed,
                 report.already_current, report.in_clear, len(report.unreadable))
        return report

    def _session_of(self, key: str) -> AbstractAsyncContextManager[None]:
        """The write lock of the session whose manifest ``key`` is."""
        tenant, _, session_id = key.removeprefix(MANIFEST_PREFIX).partition("/")
        return self.catalog.write(tenant, session_id)
