"""Maintenance half of ``TierManager``: explicit demotion and garbage collection.

``demote`` moves a session down on purpose (an operator, or the compaction job cooling a
session); ``collect_garbage`` deletes expired sessions and blocks that nothing
references, which a crash between a block write and its manifest commit, or a tier that
was down during a delete, can leave behind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvstore.errors import DataLoss, InvalidRequest, TierFull, TierUnavailable
from kvstore.manifest import SessionManifest, check_name, manifest_key
from kvstore.placement import WINDOW_PREFIX, is_window_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GarbageReport:
    expired_sessions: int
    orphan_blocks: int  # copies deleted from some tier (one block may count per tier)


class MaintenanceMixin:
    async def demote(self, tenant: str, session_id: str, tier_name: str | None = None
                     ) -> SessionManifest:
        """Move a session's blocks down to ``tier_name`` (default: the lowest tier).

        Copies above that tier are removed, shared chunks included. A window that the
        target tier cannot hold is dropped and the manifest says so.
        """
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        try:
            target = self._stack.index(tier_name or self.tiers[-1].name)
        except KeyError:
            raise InvalidRequest(f"no tier named {tier_name!r}") from None
        async with self._sessions.write((tenant, session_id)):
            manifest = await self._load_required(tenant, session_id)
            await self._gather(self._demote_block(key, target) for key in manifest.chunk_keys)
            window = manifest.window_key
            if window is None:
                return manifest
            kept = self.tiers[target].holds_window and await self._demote_window(window, target)
            if not kept:
                await self._drop_block(window)
                self.counters.windows_dropped += 1
            held = self._stack.holders(window) if kept else []
            manifest = manifest.evolve(window_tier=self.tiers[held[0]].name if held else None,
                                       window_key=window if held else None)
            await self._ledger.commit({manifest_key(tenant, session_id): manifest.encode()})
            return manifest

    async def _demote_block(self, key: str, target: int) -> None:
        async with self._locks.hold(key):
            holders = self._stack.holders(key)
            if not any(i >= target for i in holders):
                data, _, _ = await self._stack.read(key, access=False)
                if await self._stack.place(key, data, start=target) is None:
                    raise TierFull(f"no tier at or below {self.tiers[target].name} took {key}")
            for i in (i for i in holders if i < target):
                await self._stack.delete(i, key, evicted=True)

    async def _demote_window(self, key: str, target: int) -> bool:
        """Move a window blob down to ``target``; False if it is gone or finds no room."""
        try:
            await self._demote_block(key, target)
        except (DataLoss, TierFull):
            return False
        return True

    async def collect_garbage(self, now: float | None = None) -> GarbageReport:
        """Delete sessions idle past their ``ttl_s``, then unreferenced blocks in every tier.

        ``now``: wall-clock seconds (default: the current time).
        """
        now = time.time() if now is None else now
        expired = 0
        for manifest in await self.list_sessions():
            if manifest.expired(now) and await self._delete(
                manifest.tenant, manifest.session_id, lambda m: m.expired(now)
            ):
                expired += 1
        orphans = 0
        for j, tier in enumerate(self.tiers):
            if not self._stack.up(j):
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
            if self._ledger.count(key):
                return False
            async with self._locks.hold(key):
                return not self._ledger.count(key) and await self._stack.delete(j, key)
        tenant, session_id, _ = key[len(WINDOW_PREFIX):].split("/")
        # under the read lock: a spill places its window before the manifest naming it
        async with self._sessions.read((tenant, session_id)):
            try:
                manifest = await self._load(tenant, session_id)
            except DataLoss:
                return False
            if manifest is not None and manifest.window_key == key:
                return False
            async with self._locks.hold(key):
                return await self._stack.delete(j, key)
