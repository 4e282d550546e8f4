"""The tier manager: the store's library API, which the gRPC service wraps thinly.

    disk = DiskTier(path, capacity)
    manager = await TierManager.open([HostTier(capacity), disk], disk.meta)
    await manager.spill(tenant, session_id, layout_id=..., generation=1, token_ids=...,
                        chunks=[(key, encoded), ...], tail=b"", window=blob, ack="memory")
    await manager.spill_request(SpillRequest(tenant=..., ...))  # the same, as one value
    result = await manager.restore(tenant, session_id)      # or stream: manager.reading()

``TierManager`` builds its parts and delegates each public call to one of them:

- ``spill``, ``store_window``: ``Spiller`` (kvstore.session.spill);
- ``restore``, ``reading``, ``prefetch``, ``read_chunk``: ``Restorer`` (kvstore.session.restore);
- ``delete``, ``demote``, ``collect_garbage``: ``Maintenance`` (kvstore.session.maintenance);
- ``get_manifest``, ``list_sessions``, ``session_count``: ``Catalog`` (kvstore.session.catalog);
- ``lookup``: ``ChainIndex`` (kvstore.prefix.chains), in a fleet ``lookup_fleet`` asks the
  shared tiers too (kvstore.prefix.fleet_lookup); ``fork``: ``Forker`` (kvstore.session.fork);
- ``write_chunks``, ``read_chunks`` (prefix chunks of no session): ``PrefixChunks``
  (kvstore.session.prefix_chunks);
- ``start_drain`` (a node about to stop, ``kvtier drain``): ``Draining``
  (kvstore.session.draining), which every write passes;
- ``where``, ``stat``, ``drain``, ``close``, ``open``, ``tiers``: here.

The parts share one ``StoreContext`` (kvstore.session.context: the tier stack, reference
ledger, catalog, blocks, retention, quotas, write-back), whose ``Wiring`` carries the events
between them. ``docs/impl.md`` follows a Spill and a Resume through the files, with the
lock order.

Rules it keeps (placement details in ``kvstore.placement.stack``):

- Generations: a spill must present a generation strictly greater than the session's
  stored one (any generation >= 0 for a new session), else ``StaleGeneration``; the
  stored generation again with identical content is an idempotent retry (the stored
  manifest comes back), with other content ``GenerationConflict``.
- Acks: ``"memory"`` returns once every chunk is in some tier and the manifest is
  committed; chunks not yet on a durable tier are queued for background write-back.
  ``"durable"`` returns once every chunk is also on a durable tier (and needs a
  MetaStore that is itself durable, such as the disk tier's). A memory-acked session
  whose write-back failed is marked ``writeback_failed`` until a retry makes it
  durable (``kvstore.session.durability``).
- Dedupe: chunks are shared by block key (``kvstore.format.keys``: dedupe domain, layout, model
  fingerprint, tokens, and the digest of the bytes) across the sessions of this manager,
  with reference counts (``kvstore.placement.refcount``); a chunk nothing references is deleted
  from every tier, or, with ``retain_unreferenced``, kept as a cache entry that eviction
  takes first and ``lookup`` finds (``kvstore.prefix.chains.Retention``).
- Window blobs only live in tiers with ``holds_window``; when one is dropped the
  manifest's ``window_tier`` becomes None and a restore reports ``replay_needed``.
- Quotas (``quotas=``): the rules are in ``kvstore.session.quota``.
- Locks: a readers-writer lock per session (restores share it, spills/deletes/demotes
  are exclusive) and a lock per chunk key for moves; never a global lock across I/O.

One manager owns its tiers and MetaStore; ``close`` drains write-back and closes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import numpy as np

from kvstore.eviction.pause_estimate import PauseEstimator
from kvstore.eviction.policies import EvictionPolicy, LRUPolicy
from kvstore.format.errors import InvalidRequest, KVTierError
from kvstore.format.keys import (
    MAX_INDEPENDENT_LOOKUP,
    check_fingerprint,
    dedupe_scope,
    independent_keys,
    iter_chain_keys,
)
from kvstore.format.registry import get_layout
from kvstore.placement.blocks import WriteHook
from kvstore.prefix.chains import LookupResult, held_each, longest_prefix
from kvstore.prefix.fleet_lookup import held_chains, learn_each
from kvstore.remote.breaker import tripped
from kvstore.session.context import StoreContext, StoreOptions
from kvstore.session.draining import Draining, DrainProgress
from kvstore.session.fork import Forker
from kvstore.session.maintenance import DeleteResult, GarbageReport, Maintenance
from kvstore.session.manifest import SessionManifest, check_name
from kvstore.session.prefix_chunks import ChunkRead, ChunksWritten, ChunkWrite, PrefixChunks
from kvstore.session.quota import Quotas, TenantReport
from kvstore.session.restore import (
    ChunkBytes,
    PrefetchResult,
    Restorer,
    RestoreResult,
    SessionReader,
)
from kvstore.session.spill import Spiller, SpillRequest
from kvstore.tiers.base import Buffer, MemoryMetaStore, MetaStore, Tier, TierStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ManagerStats:
    tiers: tuple[TierStats, ...]  # highest first
    counters: dict  # Counters.snapshot()
    writeback_depth: int  # chunks queued for write-back now
    writeback_capacity: int
    referenced_chunks: int  # distinct chunk keys some manifest references
    sessions: int = 0  # manifests stored (TierManager.session_count)
    # Tenants with a quota table of their own, then "other" (QuotaGate.reports)
    tenants: tuple[TenantReport, ...] = ()
    retained_chunks: int = 0  # unreferenced chunks kept as cache (kvstore.prefix.chains)
    retained_bytes: int = 0


@dataclass(frozen=True)
class ManagerConfig:
    writeback_depth: int = 256  # chunks queued for write-back before spills wait
    writeback_workers: int = 2
    io_concurrency: int = 8  # chunk moves in flight per spill, restore or prefetch
    restore_lookahead: int = 8  # chunks a streamed restore fetches ahead of the reader
    unavailable_cooldown_s: float = 1.0  # how long a tier that failed is skipped
    # A failed write-back is retried after this, doubling up to the max (session.durability)
    writeback_retry_s: float = 0.5
    writeback_retry_max_s: float = 30.0
    # Spills without a hint get one inferred from past sessions (kvstore.eviction.pause_estimate);
    # only a hint-aware policy (HintPolicy) acts on it.
    infer_hints: bool = True
    # Chunks whose last reference goes away stay as evictable cache (a later session
    # with the same prefix finds them by ``lookup``), freed under pressure (tier
    # capacity, a full medium, the tenant's durable_bytes quota) or once idle for
    # retain_ttl_s (None: only under pressure); False frees them at once. Off here (the
    # library), on in the server's config.
    retain_unreferenced: bool = False
    retain_ttl_s: float | None = None


MANAGER_PRESETS = {
    "default": ManagerConfig(),
    # One process on a small machine (the embedded `kvtier serve`): fewer tasks in flight.
    "embedded": ManagerConfig(writeback_depth=64, writeback_workers=1, io_concurrency=4,
                              restore_lookahead=4),
    # Remote tiers with high latency: more in flight hides round trips.
    "remote": ManagerConfig(writeback_depth=1024, writeback_workers=8, io_concurrency=32,
                            restore_lookahead=32, unavailable_cooldown_s=5.0),
}


class TierManager:
    def __init__(
        self,
        tiers: Sequence[Tier],
        meta: MetaStore,
        *,
        policy: Callable[[], EvictionPolicy] = LRUPolicy,
        config: ManagerConfig = MANAGER_PRESETS["default"],
        quotas: Quotas = Quotas(),
        write_hook: WriteHook | None = None,
    ) -> None:
        """Use ``await TierManager.open(...)``.

        ``tiers``: highest first, names unique; ``meta``: where manifests and reference
        counts live (the disk tier's ``meta`` for durability); ``policy``: a factory
        called once per tier (``LRUPolicy``, ``HintPolicy`` or any ``EvictionPolicy``);
        ``quotas``: per-tenant limits (default: none; usage is counted all the same);
        ``write_hook``: told of every write that stores chunks, spill or WriteChunks (the
        encrypting tiers' domain claims, ``kvstore.encryption.claims``).
        """
        names = [tier.name for tier in tiers]
        if not tiers or len(set(names)) != len(names):
            raise InvalidRequest(f"need at least one tier, each name once; got {names}")
        self.config = config
        self.meta = meta
        self._pauses = PauseEstimator() if config.infer_hints else None
        self._tasks: set[asyncio.Task] = set()  # background work that drain waits for
        self.store = store = StoreContext.build(tiers, meta, policy, quotas, StoreOptions(
            io_concurrency=config.io_concurrency, cooldown_s=config.unavailable_cooldown_s,
            retain=config.retain_unreferenced, retain_ttl_s=config.retain_ttl_s,
            writeback_depth=config.writeback_depth, writeback_workers=config.writeback_workers,
            writeback_retry_s=config.writeback_retry_s,
            writeback_retry_max_s=config.writeback_retry_max_s), self._spawn, write_hook)
        self.counters = store.counters
        self._expiry: asyncio.Task | None = None  # frees retained chunks past their TTL
        self.write_hook = write_hook
        durable_meta = not isinstance(meta, MemoryMetaStore)
        self._spiller = Spiller(store, pauses=self._pauses, durable_meta=durable_meta)
        self._restorer = Restorer(store, lookahead=config.restore_lookahead)
        self._prefix = PrefixChunks(store, self._restorer, durable_meta=durable_meta)
        self._maintenance = Maintenance(store)
        self._forker = Forker(store)
        self.draining = Draining(store, self.drain)

    @classmethod
    async def open(cls, tiers: Sequence[Tier], meta: MetaStore, **options) -> TierManager:
        """Start a manager: load reference counts and learn what each tier holds."""
        manager = cls(tiers, meta, **options)
        await manager.store.ledger.load()
        await manager.store.catalog.load_count()
        await manager.store.stack.load()
        await manager._adopt_retained()
        if manager.store.retention.enabled and manager.store.retention.ttl_s is not None:
            manager._expiry = asyncio.create_task(manager._expire_retained())
        return manager

    async def _adopt_retained(self) -> None:
        """Rebuild the retained set from what the tiers hold that nothing references
        (``kvstore.prefix.chains``), and delete the marks that no longer describe one, unless
        a tier could not be listed (it may still hold their chunks)."""
        stale = self.store.retention.adopt(self.store.index.keys(), self.store.ledger.marks)
        if not stale or not all(self.store.stack.up(j) for j in range(len(self.tiers))):
            return
        self.store.ledger.unmark(stale)
        try:
            await self.store.ledger.flush_marks()
        except KVTierError as exc:  # they stay pending for the next commit
            log.warning("stale retention marks not deleted at open: %s", exc)

    async def _expire_retained(self) -> None:
        """Free retained chunks idle past ``retain_ttl_s``, checking a few times a TTL."""
        ttl = self.store.retention.ttl_s
        if ttl is None:  # no TTL: nothing expires
            return
        while True:
            await asyncio.sleep(min(max(ttl / 4, 0.05), 60.0))
            try:
                await self.store.blocks.free(self.store.retention.expired())
            except KVTierError as exc:
                log.warning("freeing expired retained chunks failed: %s", exc)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return self.store.stack.tiers

    async def __aenter__(self) -> TierManager:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # -- writes: kvstore.session.spill --

    async def spill(self, tenant: str, session_id: str, **fields) -> SessionManifest:
        """Store a session (replacing its older generation): ``spill_request`` of
        ``SpillRequest(tenant=tenant, session_id=session_id, **fields)``."""
        return await self.spill_request(SpillRequest(tenant=tenant, session_id=session_id,
                                                     **fields))

    async def spill_request(self, request: SpillRequest) -> SessionManifest:
        """Store a session (replacing its older generation); see ``Spiller.spill``."""
        with self.draining.admitting("a spill"):
            return await self._spiller.spill(request)

    async def store_window(self, tenant: str, session_id: str, generation: int,
                           window: Buffer, *, replayed_tokens: int) -> str | None:
        """Keep a window rebuilt by a replay of ``replayed_tokens`` tokens unless one at
        least as good is stored; see ``Spiller.store_window``. A draining node keeps
        none (None): its windows are being released."""
        if self.draining.active:
            return None
        return await self._spiller.store_window(tenant, session_id, generation, window,
                                                replayed_tokens=replayed_tokens)

    async def adopt_window(self, tenant: str, session_id: str, generation: int,
                           window: Buffer, *, replayed_tokens: int, from_node: str) -> str | None:
        """Keep a draining peer's window of the session here; see ``Spiller.adopt_window``.
        A draining node adopts none (``TierUnavailable``: the sender tries another)."""
        with self.draining.admitting("adopting a window"):
            return await self._spiller.adopt_window(tenant, session_id, generation, window,
                                                    replayed_tokens=replayed_tokens,
                                                    from_node=from_node)

    # -- reads: kvstore.session.restore --

    def reading(self, tenant: str, session_id: str
                ) -> AbstractAsyncContextManager[SessionReader]:
        """Stream a session under its read lock; see ``kvstore.session.restore``."""
        return self._restorer.reading(tenant, session_id)

    async def restore(self, tenant: str, session_id: str, *, want_window: bool = True
                      ) -> RestoreResult:
        """The whole session: every chunk verified, the window blob if it is still held."""
        return await self._restorer.restore(tenant, session_id, want_window=want_window)

    async def prefetch(self, tenant: str, session_id: str, timeout_s: float) -> PrefetchResult:
        """Promote a session's blocks toward the top tier within ``timeout_s``."""
        return await self._restorer.prefetch(tenant, session_id, timeout_s)

    async def read_chunk(self, manifest: SessionManifest, index: int) -> ChunkBytes:
        """The bytes of chunk ``index`` of ``manifest`` from the highest tier with a
        copy that verifies against the manifest, or ``DataLoss``. An internal read: not
        counted, not promoted; hold ``reading()`` if a concurrent spill must not race it."""
        return await self._restorer.read_chunk(manifest, index)

    # -- maintenance: kvstore.session.maintenance --

    async def delete(self, tenant: str, session_id: str) -> DeleteResult:
        """Drop a session; chunks nothing else references are deleted from every tier.
        The counts are this call's own, whatever runs concurrently."""
        return await self._maintenance.delete(tenant, session_id)

    async def demote(self, tenant: str, session_id: str, tier_name: str | None = None
                     ) -> SessionManifest:
        """Move a session's blocks down to ``tier_name`` (default: the lowest tier)."""
        return await self._maintenance.demote(tenant, session_id, tier_name)

    async def collect_garbage(self, now: float | None = None) -> GarbageReport:
        """Delete expired sessions, then unreferenced blocks in every tier."""
        return await self._maintenance.collect_garbage(now)

    # -- prefix reuse: kvstore.prefix.chains, kvstore.session.fork --

    def lookup(self, tenant: str, layout_id: str, token_ids: Sequence[int] | np.ndarray, *,
               model_fingerprint: str = "", dedupe_domain: str | None = None,
               independent: bool = False) -> LookupResult:
        """The longest prefix of ``token_ids`` (whole chunks) whose chunks some tier holds
        in the caller's dedupe domain, each chunk's block key and tiers (no I/O). The keys
        bind the domain, so another domain's blocks are never found. A spill may then name
        those chunks by block key without their bytes (``ChunksNotHeld`` if one went
        meanwhile); retained ones found count as used now. ``independent``: every whole
        chunk keyed alone (``kvstore.session.prefix_chunks``), each held one named."""
        chunk_tokens, chains = self._chains(tenant, layout_id, token_ids, model_fingerprint,
                                            dedupe_domain, independent)
        return self._held(chains, chunk_tokens, independent)

    async def lookup_fleet(self, tenant: str, layout_id: str,
                           token_ids: Sequence[int] | np.ndarray, *, model_fingerprint: str = "",
                           dedupe_domain: str | None = None, independent: bool = False
                           ) -> LookupResult:
        """``lookup`` in a fleet (metadata = "shared"): chain keys past what this node
        knows are asked of the shared tiers, Redis then the bucket, within bounds
        (``kvstore.prefix.fleet_lookup``), and what they hold is learnt. Without shared tiers
        exactly ``lookup`` (no I/O)."""
        chunk_tokens, chains = self._chains(tenant, layout_id, token_ids, model_fingerprint,
                                            dedupe_domain, independent)
        if independent and self.store.stack.shared_tiers():
            keys = list(chains)
            await learn_each(self.store.stack, self.store.index, keys)
            chains = iter(keys)
        elif self.store.stack.shared_tiers():
            chains = iter(await held_chains(self.store.stack, self.store.index, chains))
        return self._held(chains, chunk_tokens, independent)

    def _chains(self, tenant: str, layout_id: str, token_ids: Sequence[int] | np.ndarray,
                model_fingerprint: str, dedupe_domain: str | None, independent: bool
                ) -> tuple[int, Iterator[str]]:
        check_name("tenant", tenant)
        spec = get_layout(layout_id)
        scope = dedupe_scope(tenant, dedupe_domain)
        fingerprint = check_fingerprint(model_fingerprint)
        if independent:  # every chunk is asked about: bounded
            chunks = len(token_ids) // spec.chunk_tokens
            if chunks > MAX_INDEPENDENT_LOOKUP:
                raise InvalidRequest(f"a lookup of independent chunks asks about at most "
                                     f"{MAX_INDEPENDENT_LOOKUP} chunks, not {chunks}")
            return spec.chunk_tokens, iter(independent_keys(
                spec.layout_id, token_ids, spec.chunk_tokens, scope=scope,
                model_fingerprint=fingerprint))
        # Hashed as the walk goes: a miss ends it, so no token past the held prefix costs.
        return spec.chunk_tokens, iter_chain_keys(
            spec.layout_id, token_ids, spec.chunk_tokens, scope=scope,
            model_fingerprint=fingerprint)

    def _held(self, chains: Iterator[str], chunk_tokens: int, independent: bool
              ) -> LookupResult:
        found = (held_each if independent else longest_prefix)(
            self.store.index, chains, [t.name for t in self.tiers], chunk_tokens,
            lambda key: self.store.ledger.count(key) > 0)
        self.store.retention.touch(chunk.block_key for chunk in found.chunks)
        return found

    async def fork(self, tenant: str, source_session: str, new_session: str, *,
                   upto_tokens: int) -> SessionManifest:
        """Create ``new_session`` (generation 1) sharing ``source_session``'s chunks up to
        ``upto_tokens`` rounded down to a chunk boundary; at exactly the source's length
        the tail and a held window are carried too. ``PreconditionFailed`` if the new
        session exists or ``upto_tokens`` passes the source's length."""
        with self.draining.admitting("a fork"):
            return await self._forker.fork(tenant, source_session, new_session, upto_tokens)

    async def write_chunks(self, request: ChunkWrite) -> ChunksWritten:
        """Store whole chunks of a token prefix as retained cache entries of the caller's
        domain, keyed here from the tokens; see ``kvstore.session.prefix_chunks``."""
        with self.draining.admitting("a prefix chunk write"):
            return await self._prefix.write(request)

    async def read_chunks(self, tenant: str, layout_id: str,
                          token_ids: Sequence[int] | np.ndarray, *, first_chunk: int,
                          count: int, digests: Sequence[bytes] = (),
                          model_fingerprint: str = "", dedupe_domain: str | None = None,
                          independent: bool = False) -> list[ChunkRead]:
        """Chunks ``first_chunk`` on (``count`` of them) of ``token_ids`` in the caller's
        domain, each read (verified) or missing with its reason; ``independent``: each
        keyed alone; see ``kvstore.session.prefix_chunks``."""
        return await self._prefix.read(tenant, layout_id, token_ids, first_chunk=first_chunk,
                                       count=count, digests=digests,
                                       model_fingerprint=model_fingerprint,
                                       dedupe_domain=dedupe_domain, independent=independent)

    def retained_chunks(self) -> dict[str, tuple[int, int]]:
        """(chunks, bytes) retained (unreferenced, kept as cache) per dedupe domain (""
        when unknown: blocks found unreferenced at open without a mark)."""
        return self.store.retention.by_domain()

    # -- listing: kvstore.session.catalog --

    async def get_manifest(self, tenant: str, session_id: str) -> SessionManifest:
        return await self.store.catalog.load_required(check_name("tenant", tenant),
                                                 check_name("session_id", session_id))

    async def list_sessions(self, tenant: str | None = None) -> list[SessionManifest]:
        """Manifests of every session (of one tenant), sorted by tenant and id."""
        return await self.store.catalog.manifests(None if tenant is None
                                             else check_name("tenant", tenant))

    def set_quotas(self, quotas: Quotas) -> None:
        """New limits from the next admission on (a reload); usage and spills already
        admitted stay as they are."""
        self.store.quotas.quotas = quotas

    def tenant_usage(self, tenant: str) -> TenantReport:
        """The tenant's use against its quota limits (no I/O)."""
        return self.store.quotas.report(check_name("tenant", tenant))

    def session_count(self) -> int:
        """Sessions stored (expired ones not yet collected included); no I/O."""
        return self.store.catalog.held

    # -- placement, stats, lifecycle: here --

    def where(self, key: str) -> list[str]:
        """Names of the tiers believed to hold block ``key``, highest first (no I/O)."""
        return [self.tiers[i].name for i in self.store.stack.holders(key)]

    async def stat(self) -> ManagerStats:
        """Counters and per-tier gauges; no I/O (``items`` is what the manager believes
        each tier holds), so a metrics scrape never waits on a slow or absent tier."""
        store, queue = self.store, self.store.durability.queue
        tier_stats = tuple(
            TierStats(tier.name, tier.capacity_bytes, tier.used_bytes,
                      len(store.stack.policies[j]), store.stack.up(j) and not tripped(tier))
            for j, tier in enumerate(self.tiers)
        )
        return ManagerStats(
            tiers=tier_stats, counters=self.counters.snapshot(),
            writeback_depth=queue.depth, writeback_capacity=queue.capacity,
            referenced_chunks=len(store.ledger.referenced()), sessions=store.catalog.held,
            tenants=store.quotas.reports(), retained_chunks=len(store.retention),
            retained_bytes=sum(size for _, size in store.retention.by_domain().values()),
        )

    def start_drain(self, interval_s: float = 1.0) -> AsyncIterator[DrainProgress]:
        """Drain this node before it stops, reporting progress; see
        ``kvstore.session.draining``."""
        return self.draining.run(interval_s)

    async def drain(self) -> None:
        """Wait for queued write-backs and background promotions to finish."""
        while self._tasks or self.store.durability.queue.depth:
            await self.store.durability.queue.join()
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Drain, then close every tier and the MetaStore."""
        await self.drain()
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
        await self.store.durability.close()  # chunks still failing stay marked
        await self.store.durability.queue.close()
        for tier in self.tiers:
            await tier.close()
        await self.meta.close()

    def _spawn(self, coro: Awaitable) -> None:
        """Run ``coro`` in the background; ``drain`` waits for it, failures are logged."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed: %r", task.exception())
