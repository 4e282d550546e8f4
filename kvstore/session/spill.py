"""Spills: a session's chunks, tail and window stored as a new generation; store_window.

``Spiller`` places sent chunks (or confirms the ones named by key only), places the
window blob, commits the manifest with its reference changes through the ``Catalog``,
frees what the older generation alone held, and queues chunks not yet on a durable tier
for write-back (an "in memory" ack). The rules are documented on ``TierManager`` and in
``kvstore.placement.stack``.

Chunks are named by block key (chain key + digest of the bytes, ``kvstore.format.keys``), so a
dedupe is a byte-for-byte match within the spill's dedupe domain, and different bytes
for one chain key are stored as their own version. A spill repeated at the stored
generation with identical content (a client's retry after a lost reply) is answered
with the first one's receipt; other content at that generation is ``GenerationConflict``.

Every spill, and every rebuilt window kept, is admitted through ``QuotaGate.reserve``
(``kvstore.session.quota``) before anything is stored; ``Spiller._admit`` says how a spill that
would pass ``memory_bytes`` is placed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Literal

import numpy as np

from kvstore.eviction.pause_estimate import PauseEstimator
from kvstore.format.checks import check_spill, check_window, chunk_bytes_max, restored_chunk_check
from kvstore.format.errors import (
    ChunksNotHeld,
    DataLoss,
    GenerationConflict,
    InvalidRequest,
    QuotaExceeded,
    StaleGeneration,
    TierUnavailable,
)
from kvstore.format.hints import ResumeHint
from kvstore.format.keys import check_fingerprint, chunk_digest, dedupe_scope, token_bytes
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import get_layout
from kvstore.placement.blocks import Blocks
from kvstore.placement.locks import KeyedLocks
from kvstore.placement.refcount import RefLedger
from kvstore.placement.stack import WINDOW_PREFIX, Check, TierStack, not_placed
from kvstore.placement.writeback import WriteBack, WriteBackQueue
from kvstore.prefix.chains import Retention
from kvstore.session.catalog import Catalog
from kvstore.session.manifest import SessionManifest, SpillReceipt, check_name, window_coverage
from kvstore.session.quota import QuotaGate, Reservation, TenantUsage, demote_own, memory_floor
from kvstore.stats import Counters
from kvstore.tiers.base import Buffer

Ack = Literal["memory", "durable"]
log = logging.getLogger(__name__)
CHECK_ON_LOOP_BYTES = 1 << 20  # about a millisecond of hashing


class Spiller:
    def __init__(self, catalog: Catalog, blocks: Blocks, stack: TierStack, locks: KeyedLocks,
                 ledger: RefLedger, counters: Counters, writeback: WriteBackQueue, *,
                 pauses: PauseEstimator | None, durable_meta: bool, quotas: QuotaGate,
                 retention: Retention) -> None:
        """``pauses``: infers hints for spills without one (None: no inference);
        ``durable_meta``: whether manifests survive a restart (a durable ack needs it);
        ``quotas``: admits each spill against its tenant's limits; ``retention``: keeps
        chunks left unreferenced as cache (or says to free them)."""
        self._catalog = catalog
        self._blocks = blocks
        self._stack = stack
        self._locks = locks
        self._ledger = ledger
        self._counters = counters
        self._writeback = writeback
        self._pauses = pauses
        self._can_ack_durable = durable_meta and bool(blocks.durable)
        self._quotas = quotas
        self._retention = retention
        self._below = memory_floor(stack)
        self._placed_in_memory = stack.tiers[0].holds_window  # placement starts at tier 0

    async def spill(
        self,
        tenant: str,
        session_id: str,
        *,
        layout_id: str,
        generation: int,
        token_ids: Sequence[int] | np.ndarray,
        chunks: Sequence[tuple[str, Buffer | None]],
        tail: Buffer = b"",
        window: Buffer | None = None,
        ack: Ack = "memory",
        hint: ResumeHint | None = None,
        ttl_s: float | None = None,
        model_fingerprint: str = "",
        dedupe_domain: str | None = None,
    ) -> SessionManifest:
        """Store a session (replacing its older generation) and return its manifest.

        ``chunks``: (block key, codec-encoded bytes) of every complete chunk, in order,
        keys as ``kvstore.format.keys.block_keys(spec.layout_id, token_ids, spec.chunk_tokens,
        datas, scope=dedupe_scope(tenant, dedupe_domain), model_fingerprint=...)``;
        ``tail``: the encoded partial last chunk or b""; ``window``: the encoded window
        blob (``ephemeral=True``) or None. Buffers must stay unchanged until this returns.

        ``hint``: the framework's resume hint; None lets the manager infer one
        (``ManagerConfig.infer_hints``), which the manifest then records.

        ``model_fingerprint``: the weights/version id of the model (required by layouts
        with ``requires_model_fingerprint``); ``dedupe_domain``: a shared domain's name,
        None for the tenant's own. The caller decides who may use a shared domain.

        At the stored generation, the same content (token ids, block keys, tail, window,
        layout, fingerprint, domain, ack) returns the stored manifest unchanged (its
        ``receipt`` is what the first spill answered); other content raises
        ``GenerationConflict``, an older generation ``StaleGeneration``.

        A chunk given as ``(key, None)`` is one the store already holds (typically the
        previous generation's prefix): it is referenced without its bytes being sent or
        read back. If no tier holds one intact, ``ChunksNotHeld`` names them and nothing
        is stored.
        """
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        if ack not in ("memory", "durable"):
            raise InvalidRequest(f"ack must be 'memory' or 'durable', got {ack!r}")
        if ack == "durable" and not self._can_ack_durable:
            raise InvalidRequest("a durable ack needs a durable tier and a durable MetaStore")
        if not isinstance(generation, int) or generation < 0:
            raise InvalidRequest(f"generation must be an int >= 0, got {generation!r}")
        spec = get_layout(layout_id)
        tokens = np.frombuffer(token_bytes(token_ids), dtype="<u4")
        check_fingerprint(model_fingerprint)
        scope = dedupe_scope(tenant, dedupe_domain)
        keys = [key for key, _ in chunks]

        def checked() -> str:
            check_spill(spec, tokens, chunks, tail, window, scope=scope,
                        model_fingerprint=model_fingerprint)
            return _content_digest(spec.layout_id, model_fingerprint, scope, ack, tokens,
                                   keys, tail, window)

        # Every byte is hashed: a large spill is checked off the event loop.
        sent = (sum(len(data) for _, data in chunks if data is not None) + len(tail)
                + (len(window) if window is not None else 0))
        digest = (await asyncio.to_thread(checked) if sent > CHECK_ON_LOOP_BYTES
                  else checked())
        async with self._catalog.write(tenant, session_id):
            old = await self._catalog.load(tenant, session_id)
            if old is not None and generation == old.generation:
                if old.spill_digest == digest and old.receipt is not None:
                    return old  # a retry of the spill that stored it: answered as before
                raise GenerationConflict(
                    f"{tenant}/{session_id}: generation {generation} is already stored with "
                    "other content (token ids, chunk or tail digests, window, model "
                    "fingerprint, domain or ack); spill a newer generation")
            if old is not None and generation < old.generation:
                raise StaleGeneration(
                    f"{tenant}/{session_id}: generation {generation} is not newer than the "
                    f"stored {old.generation}"
                )
            if self._pauses is not None:  # learns from every spill, hinted or not
                inferred = self._pauses.on_spill(old.updated_at if old else None,
                                                 old.created_at if old else None, time.time())
                hint = hint if hint is not None else inferred
            reservation, start, keep_window = await self._admit(tenant, spec, old, chunks,
                                                                tail, window)
            self._ledger.pin(keys)
            window_key = None
            try:
                queued, sizes, deduped = await self._place_chunks(spec, tokens, chunks, old,
                                                                  hint, ack, start)
                window_tier = None
                if window is not None and not keep_window:
                    self._counters.windows_dropped += 1
                    log.info("%s/%s: window not kept, over the tenant's memory_bytes quota "
                             "(a resume replays it)", tenant, session_id)
                if window is not None and keep_window:
                    window_key = f"{WINDOW_PREFIX}{tenant}/{session_id}/{generation}"
                    window_tier = await self._store_window(window_key, window, hint)
                receipt = SpillReceipt(
                    chunks_written=len(keys) - deduped, chunks_deduped=deduped,
                    tier=self._top_tier(keys) or window_tier or "",
                    bytes_received=sum(len(d) for _, d in chunks if d is not None)
                    + len(tail) + (len(window) if window is not None else 0),
                    window_kept=window_tier is not None, durable=ack == "durable")
                now = time.time()
                manifest = SessionManifest(
                    tenant=tenant, session_id=session_id, layout_id=spec.layout_id,
                    generation=generation, token_ids=tokens, chunk_keys=tuple(keys),
                    chunk_sizes=tuple(sizes), tail=bytes(tail),
                    window_tier=window_tier,
                    window_key=window_key if window_tier is not None else None,
                    created_at=old.created_at if old else now, updated_at=now,
                    last_access=now, ttl_s=ttl_s, hint=hint,
                    model_fingerprint=model_fingerprint, dedupe_scope=scope,
                    spill_digest=digest, receipt=receipt,
                )
                freed = await self._catalog.put(
                    manifest, acquire=keys, release=old.chunk_keys if old else (),
                    new=old is None, marks=self._retention.marks(
                        old.chunk_keys, old.chunk_sizes, old.dedupe_scope) if old else None,
                )
                reservation.release()  # the committed manifest now counts in its stead
            except BaseException:
                reservation.release()
                sent = {key: len(data) for key, data in chunks if data is not None}
                await self._blocks.free(self._retention.keep(self._ledger.unpin(keys), scope,
                                                             sent))
                if window_key is not None:
                    await self._blocks.drop(window_key)
                raise
            if freed:  # the older generation's alone
                freed = self._retention.keep(freed, old.dedupe_scope, dict(
                    zip(old.chunk_keys, old.chunk_sizes, strict=True)))
            await self._blocks.free(freed + self._retention.keep(self._ledger.unpin(keys), scope))
            if old is not None and old.window_key is not None:
                await self._blocks.drop(old.window_key)
        for key in (k for k, wants_writeback in zip(keys, queued, strict=True) if wants_writeback):
            await self._writeback.submit(WriteBack(key, tenant, session_id, generation))
        self._counters.spills += 1
        return manifest

    async def _place_chunks(self, spec: LayoutSpec, tokens: np.ndarray,
                            chunks: Sequence[tuple[str, Buffer | None]],
                            old: SessionManifest | None, hint: ResumeHint | None, ack: Ack,
                            start: int) -> tuple[list[bool], list[int], int]:
        """Place the sent chunks (in tier ``start`` or lower) and confirm the ones named by
        key only (those first, so a refused spill wrote nothing). Returns, per chunk,
        whether it needs write-back and its encoded size; and how many chunks were
        already held (deduped)."""
        known = dict(zip(old.chunk_keys, old.chunk_sizes, strict=True)) if old else {}
        by_key = [i for i, (_, data) in enumerate(chunks) if data is None]
        found = await self._blocks.gather(
            self._reference_chunk(chunks[i][0], known.get(chunks[i][0]),
                                  restored_chunk_check(spec, tokens, i, chunks[i][0]), hint, ack)
            for i in by_key)
        missing = [i for i, result in zip(by_key, found, strict=True) if result is None]
        if missing:
            raise ChunksNotHeld(missing)
        protect = frozenset(key for key, _ in chunks)
        sent = [i for i, (_, data) in enumerate(chunks) if data is not None]
        stored = await self._blocks.gather(
            self._store_chunk(chunks[i][0], chunks[i][1], hint, ack, protect, start)
            for i in sent)
        results = dict(zip(by_key, found, strict=True))
        results.update((i, (wants, len(chunks[i][1])))
                       for i, (wants, _) in zip(sent, stored, strict=True))
        deduped = len(by_key) + sum(held for _, held in stored)
        return ([results[i][0] for i in range(len(chunks))],
                [results[i][1] for i in range(len(chunks))], deduped)

    async def _admit(self, tenant: str, spec: LayoutSpec, old: SessionManifest | None,
                     chunks: Sequence[tuple[str, Buffer | None]], tail: Buffer,
                     window: Buffer | None) -> tuple[Reservation, int, bool]:
        """Admit the spill against the tenant's quotas before anything is stored: (what it
        reserved, the first tier its sent chunks may take, whether its window may be kept).

        ``sessions`` and ``durable_bytes`` are refused (``QuotaExceeded``) when the spill
        would pass them; a chunk named by key whose size is unknown here counts as the
        largest chunk the layout allows. ``memory_bytes``: the spill's chunks in memory
        (sent ones land there first) plus its window, less what the older generation
        holds there. When that would pass the limit and a tier lies below the memory
        tiers, the tenant's own memory-resident data is moved down first (chunks as
        eviction moves them, windows dropped: their resumes replay); if that is not
        enough, the sent chunks go straight below the memory tiers and the window is not
        kept. Refused only when what must stay in memory (chunks named by key that no
        lower tier took) still does not fit, or when no tier lies below.
        """
        usage = self._quotas.ledger
        known = dict(zip(old.chunk_keys, old.chunk_sizes, strict=True)) if old else {}
        largest = chunk_bytes_max(spec, spec.chunk_tokens)
        stored = len(tail) + sum(len(data) if data is not None else
                                 known.get(key) or usage.memory_bytes(key) or largest
                                 for key, data in chunks)
        need = TenantUsage(sessions=int(old is None),
                           durable_bytes=stored - (old.stored_bytes if old else 0))
        await self._shed_retained(tenant, need.durable_bytes, [key for key, _ in chunks])
        self._quotas.check(tenant, need)  # before moving anything for memory
        sent = sum(len(data) for _, data in chunks if data is not None)
        sent = sent if self._placed_in_memory else 0
        extra = len(window) if window is not None else 0

        def held() -> int:  # memory the spill's chunks named by key add, net of the old's
            by_key = sum(usage.memory_bytes(key) for key, data in chunks if data is None)
            if old is None:
                return by_key
            return by_key - sum(map(usage.memory_bytes, (*old.chunk_keys, old.window_key)))

        room = self._quotas.room(tenant, "memory_bytes")
        memory, start, keep_window = held() + sent + extra, 0, True
        if room is not None and memory > room and self._below is not None:
            await demote_own(self._quotas.ledger, self._stack, self._locks, tenant,
                             memory - room, self._below,
                             {key for key, data in chunks if data is not None})
            room = self._quotas.room(tenant, "memory_bytes")
            memory = held() + sent + extra
            if room is not None and memory > room:
                memory, start, keep_window = held(), self._below, False
        return (self._quotas.reserve(tenant, dataclasses.replace(need, memory_bytes=memory)),
                start, keep_window)

    async def _shed_retained(self, tenant: str, grows: int, keys: Sequence[str]) -> None:
        """The retained chunks of the tenant's own domain live in the room its
        ``durable_bytes`` quota leaves: free the least recently used ones that a spill
        growing the use by ``grows`` needs the room of (none of ``keys``, the spill's
        own, which it references again). Nothing is freed for a spill refused anyway."""
        room = self._quotas.room(tenant, "durable_bytes")
        if room is None or grows > room:
            return
        scope = dedupe_scope(tenant)
        own = set(keys)
        excess = (self._retention.bytes_of(scope) - sum(map(self._retention.size, own))
                  + max(0, grows) - room)
        if excess > 0:
            await self._blocks.free(self._retention.over_quota(scope, excess, own))

    def _top_tier(self, keys: Sequence[str]) -> str:
        """The highest tier holding any of ``keys`` ("" when none is)."""
        tops = [holders[0] for holders in map(self._stack.holders, keys) if holders]
        return self._stack.tiers[min(tops)].name if tops else ""

    async def _reference_chunk(self, key: str, size: int | None, check: Check,
                               hint: ResumeHint | None, ack: Ack) -> tuple[bool, int] | None:
        """A chunk named by key only: None when no tier holds it intact, else (whether it
        still needs write-back, its size). Its bytes are read only when its size is
        unknown (not in the session's last manifest) or a durable ack must copy it."""
        async with self._locks.hold(key):
            self._stack.touch(key, hint)
            # one another node of the fleet wrote: Redis or the bucket knows it
            if not (await self._stack.confirmed_holder(key)
                    or await self._stack.find_shared(key)):
                return None
            durable = self._blocks.any_durable(self._stack.holders(key))
            data = None
            if size is None or (ack == "durable" and not durable):
                try:
                    data, _, _ = await self._stack.read(key, check, access=False)
                except DataLoss:
                    return None
                size = len(data)
            self._counters.dedupe_hits += 1
            if durable:
                return False, size
            if ack == "memory":
                return bool(self._blocks.durable), size
            unavailable: list[TierUnavailable] = []
            if await self._blocks.copy_to_durable(key, data, unavailable):
                return False, size
            raise not_placed(f"no durable tier took chunk {key} ({size} B)", unavailable)

    async def _store_chunk(self, key: str, data: Buffer, hint: ResumeHint | None, ack: Ack,
                           protect: frozenset[str], start: int) -> tuple[bool, bool]:
        """Place one chunk (or find it held, the very bytes: the key binds their digest);
        (whether it still needs write-back, whether it was held)."""
        async with self._locks.hold(key):
            self._stack.touch(key, hint)
            holders = await self._stack.confirmed_holder(key)
            held = bool(holders)
            unavailable: list[TierUnavailable] = []  # outages, told apart from full tiers
            if held:
                self._counters.dedupe_hits += 1
            else:
                placed = await self._stack.place(key, data, protect=protect, start=start,
                                                 unavailable=unavailable)
                if placed is None:
                    raise not_placed(f"no tier has room for chunk {key} ({len(data)} B)",
                                     unavailable)
                holders = [placed]
            durable = self._blocks.any_durable(holders)
            if durable or ack == "memory":
                await self._share(key, data, protect)
                return not durable and bool(self._blocks.durable), held
            copied, _ = await asyncio.gather(  # the bucket and Redis at once; both end here
                self._blocks.copy_to_durable(key, data, unavailable),
                self._share(key, data, protect), return_exceptions=True)
            if isinstance(copied, BaseException):
                raise copied
            if copied:
                return False, held
            raise not_placed(f"no durable tier took chunk {key} ({len(data)} B)", unavailable)

    async def _share(self, key: str, data: Buffer, protect: frozenset[str]) -> None:
        """Write the chunk through to the fleet's shared cache (Redis; nothing on a single
        node), so other nodes read it there: it is a cache, its failure fails nothing."""
        try:
            await self._stack.share(key, data, protect=protect)
        except Exception as exc:  # noqa: BLE001 - TierStack.share handles the tiers' own
            log.warning("write-through of chunk %s to the shared cache failed: %r", key, exc)

    async def _store_window(self, key: str, data: Buffer, hint: ResumeHint | None
                            ) -> str | None:
        async with self._locks.hold(key):
            self._stack.touch(key, hint)
            placed = await self._stack.place(key, data)
        if placed is None:
            self._counters.windows_dropped += 1
            log.warning("no window tier has room for %s (%d B): replay will be needed",
                        key, len(data))
            return None
        return self._stack.tiers[placed].name

    async def store_window(self, tenant: str, session_id: str, generation: int,
                           window: Buffer, *, replayed_tokens: int) -> str | None:
        """Keep a window rebuilt for the session as stored by a replay of
        ``replayed_tokens`` tokens, so the next resume need not replay again.

        Only the window changes: generation, token ids and chunks stay as they are. It
        replaces only a window of smaller ``window_coverage`` (a short replay never
        stands in for a longer one or the engine's own): one held here that covers as
        much stays, and its tier is returned; one in another node's memory (a fleet)
        stays named unless this one covers as much (then the session's window moves
        here). The blob lives in a window tier (hbm, host) or nowhere: returns the tier
        holding the session's window here, or None when none was kept here.
        ``StaleGeneration`` if the session was spilled again (or deleted and re-created)
        since ``generation``.
        """
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        async with self._catalog.write(tenant, session_id):
            manifest = await self._catalog.load_required(tenant, session_id)
            if manifest.generation != generation:
                raise StaleGeneration(f"{tenant}/{session_id} is at generation "
                                      f"{manifest.generation}, not {generation}: the "
                                      "rebuilt window belongs to an older state")
            spec = get_layout(manifest.layout_id)
            if not spec.ephemeral_streams:
                raise InvalidRequest(f"layout {spec.layout_id} has no window streams")
            n = manifest.num_tokens
            if not isinstance(replayed_tokens, int) or not 1 <= replayed_tokens <= n:
                raise InvalidRequest(f"replayed_tokens must lie in [1, {n}] (the session's "
                                     f"tokens), got {replayed_tokens!r}")
            check_window(spec, manifest.token_ids, window)
            coverage = window_coverage(replayed_tokens, n)
            old = manifest.window_key
            held = old is not None and self._stack.holders(old)
            if held and manifest.window_coverage >= coverage:
                return manifest.window_tier  # as good or better already (another resume's)
            if manifest.remote_window is not None and manifest.window_coverage > coverage:
                log.info("rebuilt window of %s/%s not kept: node %s holds one of coverage "
                         "%d > %d", tenant, session_id, manifest.node_id,
                         manifest.window_coverage, coverage)
                return None
            # its own key per replay length: the window it replaces stays readable until
            # the manifest names this one
            key = f"{WINDOW_PREFIX}{tenant}/{session_id}/{generation}r{replayed_tokens}"
            await self._blocks.drop(key)  # a leftover copy must not stand in for this one
            tier = await self._store_rebuilt(tenant, session_id, key, window, manifest.hint)
            if tier is None:
                return None
            try:
                await self._catalog.put(manifest.evolve(
                    window_tier=tier, window_key=key, window_replayed=replayed_tokens,
                    remote_window=None))
            except BaseException:
                await self._blocks.drop(key)
                raise
            if old is not None and old != key:
                await self._blocks.drop(old)
            return tier

    async def _store_rebuilt(self, tenant: str, session_id: str, key: str, data: Buffer,
                             hint: ResumeHint | None) -> str | None:
        """``_store_window`` for a rebuilt window, admitted as memory the tenant holds
        (None, not kept, past ``memory_bytes``). The reservation covers the placement
        only: a window blob counts for its owner from the moment a memory tier holds it."""
        try:
            reservation = self._quotas.reserve(
                tenant, TenantUsage(memory_bytes=len(data)), count=False, what="window")
        except QuotaExceeded:
            self._counters.windows_dropped += 1
            log.info("%s/%s: rebuilt window not kept, over the tenant's memory_bytes quota",
                     tenant, session_id)
            return None
        with reservation:
            return await self._store_window(key, data, hint)


def _content_digest(layout_id: str, model_fingerprint: str, scope: str, ack: str,
                    tokens: np.ndarray, keys: Sequence[str], tail: Buffer,
                    window: Buffer | None) -> str:
    """BLAKE2b-256 over everything a spill stores (block keys bind each chunk's bytes);
    length-prefixed fields, so no two different spills encode alike."""
    h = hashlib.blake2b(digest_size=32, person=b"kvtier-spill-v1")
    parts = [layout_id.encode(), model_fingerprint.encode(), scope.encode(), ack.encode(),
             tokens.tobytes(), *(key.encode() for key in keys), chunk_digest(tail),
             b"" if window is None else chunk_digest(window)]
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.hexdigest()
