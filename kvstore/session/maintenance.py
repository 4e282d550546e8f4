"""Maintenance: deletes, explicit demotion, garbage collection.

``Maintenance.delete`` drops a session and frees the chunks nothing else references;
``demote`` moves a session down on purpose (an operator, or the compaction job cooling a
session); ``collect_garbage`` deletes expired sessions and blocks that nothing
references, which a crash between a block write and its manifest commit, or a tier that
was down during a delete, can leave behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.format.errors import DataLoss, InvalidRequest, TierFull, TierUnavailable
from kvstore.placement.stack import WINDOW_PREFIX, is_window_key, not_placed
from kvstore.session.manifest import SessionManifest, check_name

if TYPE_CHECKING:  # the context is built from the parts, this one's function included
    from kvstore.session.context import StoreContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeleteResult:
    chunks_released: int  # chunk references the session's manifest held
    chunks_freed: int  # chunks this delete removed from every tier (nothing else held them)


@dataclass(frozen=True)
class GarbageReport:
    expired_sessions: int
    orphan_blocks: int  # copies deleted from some tier (one block may count per tier)


class Maintenance:
    def __init__(self, store: StoreContext) -> None:
        self._store = store

    async def delete(self, tenant: str, session_id: str) -> DeleteResult:
        """See ``TierManager.delete``."""
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        deleted = await self._delete_if(tenant, session_id, lambda manifest: True)
        assert deleted is not None  # the condition holds for any session
        return deleted

    async def _delete_if(self, tenant: str, session_id: str,
                         condition: Callable[[SessionManifest], bool]) -> DeleteResult | None:
        """Delete the session if ``condition(manifest)`` holds under its write lock."""
        async with self._store.catalog.write(tenant, session_id):
            try:
                manifest = await self._store.catalog.load_required(tenant, session_id)
            except DataLoss:
                log.error("deleting the corrupt manifest of %s/%s: its chunks stay referenced",
                          tenant, session_id)
                await self._store.catalog.remove(tenant, session_id)
                return DeleteResult(0, 0)
            if not condition(manifest):
                return None
            scope, sizes = manifest.dedupe_scope, manifest.chunk_sizes
            freed = await self._store.catalog.remove(
                tenant, session_id, release=manifest.chunk_keys,
                marks=self._store.retention.marks(manifest.chunk_keys, sizes, scope))
            freed_here = await self._store.blocks.release(
                freed, scope, dict(zip(manifest.chunk_keys, sizes, strict=True)))
            if manifest.window_key is not None:
                await self._store.blocks.drop(manifest.window_key)
            return DeleteResult(len(manifest.chunk_keys), freed_here)

    async def demote(self, tenant: str, session_id: str, tier_name: str | None = None
                     ) -> SessionManifest:
        """Move a session's blocks down to ``tier_name`` (default: the lowest tier).

        Copies above that tier are removed, shared chunks included. A window that the
        target tier cannot hold is dropped (the manifest is not rewritten: it loads
        without a window no tier holds, ``kvstore.session.catalog``); the manifest
        returned says where the window is now.
        """
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        try:
            target = self._store.stack.index(tier_name or self._store.stack.tiers[-1].name)
        except KeyError:
            raise InvalidRequest(f"no tier named {tier_name!r}") from None
        async with self._store.catalog.write(tenant, session_id):
            manifest = await self._store.catalog.load_required(tenant, session_id)
            await self._store.blocks.gather(self._demote_block(key, target)
                                      for key in manifest.chunk_keys)
            window = manifest.window_key
            if window is None:
                return manifest
            tiers = self._store.stack.tiers
            kept = tiers[target].holds_window and await self._demote_window(window, target)
            if not kept:
                await self._store.blocks.drop(window)
                self._store.stack.window_lost()
            return await self._store.catalog.load_required(tenant, session_id)

    async def _demote_block(self, key: str, target: int) -> None:
        async with self._store.locks.hold(key):
            unavailable: list[TierUnavailable] = []
            if not await self._store.stack.demote(key, target, unavailable):
                raise not_placed(f"no tier at or below {self._store.stack.tiers[target].name} "
                                 f"took {key}", unavailable)

    async def _demote_window(self, key: str, target: int) -> bool:
        """Move a window blob down to ``target``; False if it is gone or finds no room."""
        try:
            await self._demote_block(key, target)
        except (DataLoss, TierFull):
            return False
        return True

    async def collect_garbage(self, now: float | None = None) -> GarbageReport:
        """Delete sessions idle past their ``ttl_s``, then unreferenced blocks in every tier
        (retained ones only once idle past ``retain_ttl_s``).

        ``now``: wall-clock seconds (default: the current time).
        """
        now = time.time() if now is None else now
        expired = 0
        for manifest in await self._store.catalog.manifests():
            if manifest.expired(now) and await self._delete_if(
                manifest.tenant, manifest.session_id, lambda m: m.expired(now)
            ):
                expired += 1
        orphans = await self._store.blocks.free(self._store.retention.expired())
        for j, tier in enumerate(self._store.stack.tiers):
            if not self._store.stack.up(j):
                continue
            listing = tier.keys()
            try:
                keys = [key async for key in listing]
            except TierUnavailable as exc:
                log.warning("garbage collection skips tier %s: %s", tier.name, exc)
                continue
            for key in keys:
                orphans += await self._collect_block(j, key)
        if expired or orphans:
            log.info("garbage collection: %d expired sessions, %d orphan blocks",
                     expired, orphans)
        return GarbageReport(expired, orphans)

    async def _collect_block(self, j: int, key: str) -> bool:
        """Delete ``key`` from tier ``j`` if nothing references it. Locks are taken in the
        manager's one order, session before key, as a spill takes them."""
        if not is_window_key(key):
            if self._store.ledger.count(key) or self._store.retention.retained(key):
                return False  # referenced, or kept as cache (until pressure or its TTL)
            async with self._store.locks.hold(key):
                return not self._store.ledger.count(key) and await self._store.stack.delete(j, key)
        tenant, session_id, _ = key[len(WINDOW_PREFIX):].split("/")
        # under the read lock: a spill places its window before the manifest naming it
        async with self._store.catalog.read(tenant, session_id):
            try:
                manifest = await self._store.catalog.load(tenant, session_id)
            except DataLoss:
                return False
            if manifest is not None and manifest.window_key == key:
                return False
            async with self._store.locks.hold(key):
                return await self._store.stack.delete(j, key)
