"""The tier manager: the store's library API, which the gRPC service wraps thinly.

    disk = DiskTier(path, capacity)
    manager = await TierManager.open([HostTier(capacity), disk], disk.meta)
    await manager.spill(tenant, session_id, layout_id=..., generation=1, token_ids=...,
                        chunks=[(key, encoded), ...], tail=b"", window=blob, ack="memory")
    result = await manager.restore(tenant, session_id)      # or stream: manager.reading()

Public calls: ``spill``, ``store_window`` (kvstore.spill); ``restore``, ``reading``,
``prefetch`` (kvstore.restore); ``demote``, ``collect_garbage`` (kvstore.maintenance);
``delete``, ``get_manifest``, ``list_sessions``, ``session_count``, ``where``,
``read_chunk``, ``stat``, ``drain``, ``close`` (here).

Rules it keeps (placement details in ``kvstore.placement``):

- Generations: a spill must present a generation strictly greater than the session's
  stored one (any generation >= 0 for a new session), else ``StaleGeneration``. A retried
  spill of the same generation is therefore refused too: read the manifest to check it.
- Acks: ``"memory"`` returns once every chunk is in some tier and the manifest is
  committed; chunks not yet on a durable tier are queued for background write-back.
  ``"durable"`` returns once every chunk is also on a durable tier (and needs a
  MetaStore that is itself durable, such as the disk tier's).
- Dedupe: chunks are shared by key across every session of this manager (one namespace)
  with reference counts (``kvstore.refcount``); a chunk nothing references is deleted
  from every tier.
- Window blobs only live in tiers with ``holds_window``; when one is dropped the
  manifest's ``window_tier`` becomes None and a restore reports ``replay_needed``.
- Locks: a readers-writer lock per session (restores share it, spills/deletes/demotes
  are exclusive) and a lock per chunk key for moves; never a global lock across I/O.

One manager owns its tiers and MetaStore; ``close`` drains write-back and closes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass

from kvstore.errors import (
    ChunkCorrupt,
    DataLoss,
    InvalidRequest,
    SessionNotFound,
)
from kvstore.layout import get_layout
from kvstore.locks import KeyedLocks, RWLocks
from kvstore.maintenance import MaintenanceMixin
from kvstore.manifest import MANIFEST_PREFIX, SessionManifest, check_name, manifest_key
from kvstore.pause_estimate import PauseEstimator
from kvstore.placement import WINDOW_PREFIX, TierStack
from kvstore.policy import EvictionPolicy, LRUPolicy
from kvstore.refcount import RefLedger
from kvstore.restore import ReadingMixin
from kvstore.spill import SpillMixin
from kvstore.stats import Counters, ManagerStats
from kvstore.tiers.base import Buffer, MetaStore, Tier, TierStats
from kvstore.validate import restored_chunk_check
from kvstore.writeback import WriteBackQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeleteResult:
    chunks_released: int  # chunk references the session's manifest held
    chunks_freed: int  # chunks this delete removed from every tier (nothing else held them)


@dataclass(frozen=True)
class ManagerConfig:
    writeback_depth: int = 256  # chunks queued for write-back before spills wait
    writeback_workers: int = 2
    io_concurrency: int = 8  # chunk moves in flight per spill, restore or prefetch
    restore_lookahead: int = 8  # chunks a streamed restore fetches ahead of the reader
    unavailable_cooldown_s: float = 1.0  # how long a tier that failed is skipped
    # Spills without a hint get one inferred from past sessions (kvstore.pause_estimate);
    # only a hint-aware policy (HintPolicy) acts on it.
    infer_hints: bool = True


MANAGER_PRESETS = {
    "default": ManagerConfig(),
    # One process on a small machine (the embedded `kvtier serve`): fewer tasks in flight.
    "embedded": ManagerConfig(writeback_depth=64, writeback_workers=1, io_concurrency=4,
                              restore_lookahead=4),
    # Remote tiers with high latency: more in flight hides round trips.
    "remote": ManagerConfig(writeback_depth=1024, writeback_workers=8, io_concurrency=32,
                            restore_lookahead=32, unavailable_cooldown_s=5.0),
}


class TierManager(SpillMixin, ReadingMixin, MaintenanceMixin):
    def __init__(
        self,
        tiers: Sequence[Tier],
        meta: MetaStore,
        *,
        policy: Callable[[], EvictionPolicy] = LRUPolicy,
        config: ManagerConfig = MANAGER_PRESETS["default"],
    ) -> None:
        """Use ``await TierManager.open(...)``.

        ``tiers``: highest first, names unique; ``meta``: where manifests and reference
        counts live (the disk tier's ``meta`` for durability); ``policy``: a factory
        called once per tier (``LRUPolicy``, ``HintPolicy`` or any ``EvictionPolicy``).
        """
        names = [tier.name for tier in tiers]
        if not tiers or len(set(names)) != len(names):
            raise InvalidRequest(f"need at least one tier, each name once; got {names}")
        self.config = config
        self.meta = meta
        self.counters = Counters()
        self._pauses = PauseEstimator() if config.infer_hints else None
        self._locks = KeyedLocks()
        self._sessions = RWLocks()
        self._ledger = RefLedger(meta)
        self._sessions_held = 0  # manifests in the MetaStore; see session_count
        self._stack = TierStack(
            tiers, policy, self._locks, self.counters,
            is_referenced=lambda key: self._ledger.count(key) > 0,
            on_window_dropped=lambda key: self._spawn(self._forget_window(key)),
            cooldown_s=config.unavailable_cooldown_s,
        )
        self._durable = [i for i, tier in enumerate(tiers) if tier.durable]
        self._io = asyncio.Semaphore(config.io_concurrency)
        self._tasks: set[asyncio.Task] = set()
        self._writeback = WriteBackQueue(
            self._write_back, depth=config.writeback_depth, workers=config.writeback_workers
        )

    @classmethod
    async def open(cls, tiers: Sequence[Tier], meta: MetaStore, **options) -> TierManager:
        """Start a manager: load reference counts and learn what each tier holds."""
        manager = cls(tiers, meta, **options)
        await manager._ledger.load()
        manager._sessions_held = len(await meta.scan(MANIFEST_PREFIX))  # not decoded
        await manager._stack.load()
        return manager

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return self._stack.tiers

    async def __aenter__(self) -> TierManager:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # -- delete --

    async def delete(self, tenant: str, session_id: str) -> DeleteResult:
        """Drop a session; chunks nothing else references are deleted from every tier.
        The counts are this call's own, whatever runs concurrently."""
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        return await self._delete(tenant, session_id, lambda manifest: True)

    async def _delete(self, tenant: str, session_id: str,
                      condition: Callable[[SessionManifest], bool]) -> DeleteResult | None:
        """Delete the session if ``condition(manifest)`` holds under its write lock."""
        async with self._sessions.write((tenant, session_id)):
            try:
                manifest = await self._load_required(tenant, session_id)
            except DataLoss:
                log.error("deleting the corrupt manifest of %s/%s: its chunks stay referenced",
                          tenant, session_id)
                await self._ledger.commit({manifest_key(tenant, session_id): None})
                self._sessions_held -= 1
                return DeleteResult(0, 0)
            if not condition(manifest):
                return None
            freed = await self._ledger.commit(
                {manifest_key(tenant, session_id): None}, release=manifest.chunk_keys
            )
            self._sessions_held -= 1
            freed_here = await self._free(freed)
            if manifest.window_key is not None:
                await self._drop_block(manifest.window_key)
            return DeleteResult(len(manifest.chunk_keys), freed_here)

    # -- listing, stats, lifecycle --

    async def get_manifest(self, tenant: str, session_id: str) -> SessionManifest:
        return await self._load_required(check_name("tenant", tenant),
                                         check_name("session_id", session_id))

    def where(self, key: str) -> list[str]:
        """Names of the tiers believed to hold block ``key``, highest first (no I/O)."""
        return [self.tiers[i].name for i in self._stack.holders(key)]

    async def read_chunk(self, manifest: SessionManifest, index: int) -> tuple[Buffer, str]:
        """(bytes, tier) of chunk ``index`` of ``manifest`` from the highest tier with a
        copy that verifies against the manifest, or ``DataLoss``. An internal read: not
        counted, not promoted; hold ``reading()`` if a concurrent spill must not race it."""
        if not 0 <= index < len(manifest.chunk_keys):
            raise InvalidRequest(f"chunk index {index} out of range "
                                 f"({len(manifest.chunk_keys)} chunks)")
        check = restored_chunk_check(get_layout(manifest.layout_id), manifest.token_ids, index)
        data, source, _ = await self._stack.read(manifest.chunk_keys[index], check,
                                                 access=False)
        return data, self.tiers[source].name

    async def list_sessions(self, tenant: str | None = None) -> list[SessionManifest]:
        """Manifests of every session (of one tenant), sorted by tenant and id."""
        prefix = MANIFEST_PREFIX if tenant is None else manifest_key(check_name("tenant", tenant),
                                                                     "")
        out = []
        for key, value in await self.meta.scan(prefix):
            try:
                out.append(SessionManifest.decode(value))
            except ChunkCorrupt as exc:
                log.error("skipping corrupt manifest %s: %s", key, exc)
        return out

    def session_count(self) -> int:
        """Sessions stored (expired ones not yet collected included); no I/O."""
        return self._sessions_held

    async def stat(self) -> ManagerStats:
        """Counters and per-tier gauges; no I/O (``items`` is what the manager believes
        each tier holds), so a metrics scrape never waits on a slow or absent tier."""
        tier_stats = tuple(
            TierStats(tier.name, tier.capacity_bytes, tier.used_bytes,
                      len(self._stack.policies[j]), self._stack.up(j))
            for j, tier in enumerate(self.tiers)
        )
        return ManagerStats(
            tiers=tier_stats, counters=self.counters.snapshot(),
            writeback_depth=self._writeback.depth, writeback_capacity=self._writeback.capacity,
            referenced_chunks=len(self._ledger.referenced()), sessions=self._sessions_held,
        )

    async def drain(self) -> None:
        """Wait for queued write-backs and background promotions to finish."""
        while self._tasks or self._writeback.depth:
            await self._writeback.join()
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Drain, then close every tier and the MetaStore."""
        await self.drain()
        await self._writeback.close()
        for tier in self.tiers:
            await tier.close()
        await self.meta.close()

    # -- internals --

    async def _load(self, tenant: str, session_id: str) -> SessionManifest | None:
        raw = await self.meta.get(manifest_key(tenant, session_id))
        if raw is None:
            return None
        try:
            return SessionManifest.decode(raw)
        except ChunkCorrupt as exc:
            raise DataLoss(f"the manifest of {tenant}/{session_id} is corrupt: {exc}") from exc

    async def _load_required(self, tenant: str, session_id: str) -> SessionManifest:
        manifest = await self._load(tenant, session_id)
        if manifest is None:
            raise SessionNotFound(f"no session {tenant}/{session_id}")
        return manifest

    async def _gather(self, coros: Iterable[Coroutine]) -> list:
        """Run ``coros`` at most ``io_concurrency`` at a time; on failure cancel the rest."""
        async def bounded(coro: Coroutine):
            async with self._io:
                return await coro

        coros = list(coros)
        tasks = [asyncio.ensure_future(bounded(c)) for c in coros]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for coro in coros:
                coro.close()  # those cancelled before they started
            raise

    async def _free(self, keys: Sequence[str]) -> int:
        """Delete unreferenced ``keys`` from every tier; how many this call freed."""
        async def free(key: str) -> bool:
            async with self._locks.hold(key):
                if self._ledger.count(key):
                    return False  # referenced again (or pinned by a spill) meanwhile
                held = bool(self._stack.holders(key))  # False: another call freed it first
                await self._stack.delete_everywhere(key)
                self.counters.freed_chunks += held
                return held

        return sum(await self._gather(free(key) for key in dict.fromkeys(keys)))

    async def _drop_block(self, key: str) -> None:
        async with self._locks.hold(key):
            await self._stack.delete_everywhere(key)

    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed: %r", task.exception())

    async def _forget_window(self, key: str) -> None:
        """A window was evicted below the window tiers: record that replay is needed."""
        tenant, session_id, _ = key[len(WINDOW_PREFIX):].split("/")
        async with self._sessions.write((tenant, session_id)):
            manifest = await self._load(tenant, session_id)
            if manifest is None or manifest.window_key != key or self._stack.holders(key):
                return
            await self._ledger.commit({manifest_key(tenant, session_id): manifest.evolve(
                window_tier=None, window_key=None).encode()})

    async def _note_access(self, tenant: str, session_id: str, generation: int) -> None:
        async with self._sessions.write((tenant, session_id)):
            with contextlib.suppress(DataLoss):  # a corrupt manifest is reported elsewhere
                manifest = await self._load(tenant, session_id)
                if manifest is not None and manifest.generation == generation:
                    await self._ledger.commit({manifest_key(tenant, session_id): manifest.evolve(
                        last_access=time.time()).encode()})
