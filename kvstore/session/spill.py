"""Spills: a session's chunks, tail and window stored as a new generation; store_window.

``Spiller`` places sent chunks (or confirms the ones named by key only) and the window
blob, commits the manifest with its reference changes through the ``Catalog``, lets go
of what the older generation alone held, and queues chunks not yet on a durable tier for
write-back (an "in memory" ack). Rules: ``TierManager``, ``kvstore.placement.stack``, and
for admission ``kvstore.session.quota``. Chunks are named by block key (chain key and the
digest of the bytes, ``kvstore.format.keys``): a dedupe is a byte-for-byte match within
the spill's dedupe domain, and other bytes for one chain key are a version of their own.
A spill's chunks are admitted through ``Blocks.admitting`` once its checks proved
their keys (the write hook learns their domain there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from kvstore.eviction.pause_estimate import PauseEstimator
from kvstore.format.checks import check_spill, check_window, chunk_bytes_max, restored_chunk_check
from kvstore.format.errors import (
    ChunksNotHeld,
    CodecError,
    GenerationConflict,
    InvalidRequest,
    QuotaExceeded,
    StaleGeneration,
)
from kvstore.format.hints import ResumeHint
from kvstore.format.keys import check_fingerprint, chunk_digest, dedupe_scope, token_bytes
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import get_layout
from kvstore.placement.blocks import BlockWrite, ChunkOutcome
from kvstore.placement.stack import WINDOW_PREFIX
from kvstore.placement.writeback import WriteBack
from kvstore.session.context import StoreContext
from kvstore.session.manifest import (
    SessionManifest,
    SpillReceipt,
    check_name,
    full_window,
    window_coverage,
)
from kvstore.session.quota import Reservation, TenantUsage, demote_own, memory_floor
from kvstore.tiers.base import Buffer

Ack = Literal["memory", "durable"]
log = logging.getLogger(__name__)
CHECK_ON_LOOP_BYTES = 1 << 20  # about a millisecond of hashing


@dataclass(frozen=True, kw_only=True)
class SpillRequest:
    """One spill: a session's new generation. ``chunks``: (block key as
    ``kvstore.format.keys.block_keys`` makes it, encoded bytes) of every complete chunk
    in order, or (key, None) for one the store holds already (referenced unread);
    ``tail``: the partial last chunk or b""; ``window``: the window blob or None (buffers
    unchanged until the spill returns); ``hint``: None lets the manager infer one;
    ``model_fingerprint``: the model's weights/version id (required by layouts with
    ``requires_model_fingerprint``); ``dedupe_domain``: a shared domain, None for the
    tenant's own (the caller decides who may use one)."""

    tenant: str
    session_id: str
    layout_id: str
    generation: int
    token_ids: Sequence[int] | np.ndarray
    chunks: Sequence[tuple[str, Buffer | None]]
    tail: Buffer = b""
    window: Buffer | None = None
    ack: Ack = "memory"
    hint: ResumeHint | None = None
    ttl_s: float | None = None
    model_fingerprint: str = ""
    dedupe_domain: str | None = None

    @property
    def keys(self) -> list[str]:
        return [key for key, _ in self.chunks]

    @property
    def sent_bytes(self) -> int:
        """The bytes the spill carries: sent chunks, tail and window."""
        return (sum(len(data) for _, data in self.chunks if data is not None) + len(self.tail)
                + (len(self.window) if self.window is not None else 0))


class Admission(NamedTuple):
    reservation: Reservation  # released once the manifest is committed, or the spill failed
    start: int  # the first tier the sent chunks may take
    keep_window: bool


class Spiller:
    def __init__(self, store: StoreContext, *, pauses: PauseEstimator | None,
                 durable_meta: bool) -> None:
        """``pauses``: infers hints for spills without one (None: no inference);
        ``durable_meta``: whether manifests survive a restart (a durable ack needs it)."""
        self._store = store
        self._pauses = pauses
        self._can_ack_durable = durable_meta and bool(store.blocks.durable)
        self._below = memory_floor(store.stack)
        self._placed_in_memory = store.stack.tiers[0].holds_window  # placement starts at 0

    async def spill(self, request: SpillRequest) -> SessionManifest:
        """Store a session (replacing its older generation) and return its manifest.

        At the stored generation, the same content (token ids, block keys, tail, window,
        layout, fingerprint, domain, ack) returns the stored manifest unchanged (its
        ``receipt`` is what the first spill answered: a client's retry after a lost
        reply); other content raises ``GenerationConflict``, an older generation
        ``StaleGeneration``. If no tier holds a chunk named by key intact,
        ``ChunksNotHeld`` names them and nothing is stored.
        """
        spec, tokens, scope, digest = await self._checked(request)
        with self._store.blocks.admitting(BlockWrite(scope, spec.layout_hash, tuple(request.keys))):
            return await self._spill(request, spec, tokens, scope, digest)

    async def _checked(self, r: SpillRequest) -> tuple[LayoutSpec, np.ndarray, str, str]:
        """The spill checked whole (``check_spill``): its layout, token ids, dedupe scope
        and content digest."""
        tenant, session_id, generation, ack = r.tenant, r.session_id, r.generation, r.ack
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        if ack not in ("memory", "durable"):
            raise InvalidRequest(f"ack must be 'memory' or 'durable', got {ack!r}")
        if ack == "durable" and not self._can_ack_durable:
            raise InvalidRequest("a durable ack needs a durable tier and a durable MetaStore")
        if not isinstance(generation, int) or generation < 0:
            raise InvalidRequest(f"generation must be an int >= 0, got {generation!r}")
        spec = get_layout(r.layout_id)
        tokens = np.frombuffer(token_bytes(r.token_ids), dtype="<u4")
        check_fingerprint(r.model_fingerprint)
        scope = dedupe_scope(tenant, r.dedupe_domain)

        def checked() -> str:
            check_spill(spec, tokens, r.chunks, r.tail, r.window, scope=scope,
                        model_fingerprint=r.model_fingerprint)
            return _content_digest(spec.layout_id, r.model_fingerprint, scope, ack, tokens,
                                   r.keys, r.tail, r.window)

        # Every byte is hashed: a large spill is checked off the event loop.
        digest = (await asyncio.to_thread(checked) if r.sent_bytes > CHECK_ON_LOOP_BYTES
                  else checked())
        return spec, tokens, scope, digest

    async def _spill(self, r: SpillRequest, spec: LayoutSpec, tokens: np.ndarray, scope: str,  # noqa: C901 - one spill's steps under its session lock
                     digest: str) -> SessionManifest:
        tenant, session_id, generation, ack = r.tenant, r.session_id, r.generation, r.ack
        keys = r.keys
        async with self._store.catalog.write(tenant, session_id):
            old = await self._store.catalog.load(tenant, session_id)
            if old is not None and generation == old.generation:
                if old.spill_digest == digest and old.receipt is not None:
                    return self._retried(old)  # a retry of the spill that stored it
                raise GenerationConflict(
                    f"{tenant}/{session_id}: generation {generation} is already stored with "
                    "other content (token ids, chunk or tail digests, window, model "
                    "fingerprint, domain or ack); spill a newer generation")
            if old is not None and generation < old.generation:
                raise StaleGeneration(
                    f"{tenant}/{session_id}: generation {generation} is not newer than the "
                    f"stored {old.generation}"
                )
            hint = r.hint
            if self._pauses is not None:  # learns from every spill, hinted or not
                inferred = self._pauses.on_spill(old.updated_at if old else None,
                                                 old.created_at if old else None, time.time())
                hint = hint if hint is not None else inferred
            admitted = await self._admit(r, spec, old)
            self._store.ledger.pin(keys)
            window_key = None
            try:
                outcomes = await self._place_chunks(spec, tokens, r.chunks, old, hint, ack,
                                                    admitted.start)
                window_tier = None
                if r.window is not None and not admitted.keep_window:
                    self._store.stack.window_lost()
                    log.info("%s/%s: window not kept, over the tenant's memory_bytes quota "
                             "(a resume replays it)", tenant, session_id)
                if r.window is not None and admitted.keep_window:
                    window_key = f"{WINDOW_PREFIX}{tenant}/{session_id}/{generation}"
                    window_tier = await self._store_window(window_key, r.window, hint)
                deduped = sum(outcome.held for outcome in outcomes)
                receipt = SpillReceipt(
                    chunks_written=len(keys) - deduped, chunks_deduped=deduped,
                    tier=self._top_tier(keys) or window_tier or "",
                    bytes_received=r.sent_bytes, window_kept=window_tier is not None,
                    durable=ack == "durable")
                now = time.time()
                manifest = SessionManifest(
                    tenant=tenant, session_id=session_id, layout_id=spec.layout_id,
                    generation=generation, token_ids=tokens, chunk_keys=tuple(keys),
                    chunk_sizes=tuple(outcome.size for outcome in outcomes),
                    tail=bytes(r.tail), window_tier=window_tier,
                    window_key=window_key if window_tier is not None else None,
                    created_at=old.created_at if old else now, updated_at=now,
                    last_access=now, ttl_s=r.ttl_s, hint=hint,
                    model_fingerprint=r.model_fingerprint, dedupe_scope=scope,
                    spill_digest=digest, receipt=receipt,
                )
                freed = await self._store.catalog.put(
                    manifest, acquire=keys, release=old.chunk_keys if old else (),
                    new=old is None, marks=self._store.retention.marks(
                        old.chunk_keys, old.chunk_sizes, old.dedupe_scope) if old else None,
                )
                admitted.reservation.release()  # the committed manifest counts in its stead
            except BaseException:
                admitted.reservation.release()
                sent = {key: len(data) for key, data in r.chunks if data is not None}
                await self._store.blocks.release(self._store.ledger.unpin(keys), scope, sent)
                if window_key is not None:
                    await self._store.blocks.drop(window_key)
                raise
            if freed and old is not None:  # the older generation's alone (it had one)
                await self._store.blocks.release(freed, old.dedupe_scope, dict(
                    zip(old.chunk_keys, old.chunk_sizes, strict=True)))
            await self._store.blocks.release(self._store.ledger.unpin(keys), scope)
            if old is not None and old.window_key is not None:
                await self._store.blocks.drop(old.window_key)
        for key, outcome in zip(keys, outcomes, strict=True):
            if outcome.needs_writeback:
                await self._store.durability.queue.submit(
                    WriteBack(key, tenant, session_id, generation))
        self._store.counters.spills += 1
        return manifest

    async def _place_chunks(self, spec: LayoutSpec, tokens: np.ndarray,
                            chunks: Sequence[tuple[str, Buffer | None]],
                            old: SessionManifest | None, hint: ResumeHint | None, ack: Ack,
                            start: int) -> list[ChunkOutcome]:
        """Place the sent chunks (in tier ``start`` or lower) and confirm the ones named by
        key only (those first, so a refused spill wrote nothing); each chunk's outcome."""
        known = dict(zip(old.chunk_keys, old.chunk_sizes, strict=True)) if old else {}
        by_key = [i for i, (_, data) in enumerate(chunks) if data is None]
        found = await self._store.blocks.gather(
            self._store.blocks.reference(chunks[i][0], known.get(chunks[i][0]),
                                   restored_chunk_check(spec, tokens, i, chunks[i][0]), hint,
                                   durable_ack=ack == "durable")
            for i in by_key)
        missing = [i for i, result in zip(by_key, found, strict=True) if result is None]
        if missing:
            raise ChunksNotHeld(missing)
        protect = frozenset(key for key, _ in chunks)
        given = [(i, key, data) for i, (key, data) in enumerate(chunks) if data is not None]
        sent = [i for i, _, _ in given]
        stored = await self._store.blocks.gather(
            self._store.blocks.store(key, data, hint, protect, start,
                                     durable_ack=ack == "durable")
            for _, key, data in given)
        outcomes = dict(zip(by_key, found, strict=True)) | dict(zip(sent, stored, strict=True))
        return [outcomes[i] for i in range(len(chunks))]

    async def _admit(self, r: SpillRequest, spec: LayoutSpec, old: SessionManifest | None
                     ) -> Admission:
        """Admit the spill against the tenant's quotas before anything is stored, as
        ``kvstore.session.quota`` states the rules (a chunk named by key whose size is
        unknown here counts as the largest chunk the layout allows)."""
        tenant, chunks = r.tenant, r.chunks
        usage = self._store.quotas.ledger
        known = dict(zip(old.chunk_keys, old.chunk_sizes, strict=True)) if old else {}
        largest = chunk_bytes_max(spec, spec.chunk_tokens)
        stored = len(r.tail) + sum(len(data) if data is not None else
                                   known.get(key) or usage.memory_bytes(key) or largest
                                   for key, data in chunks)
        need = TenantUsage(sessions=int(old is None),
                           durable_bytes=stored - (old.stored_bytes if old else 0))
        await self._shed_retained(tenant, need.durable_bytes, r.keys)
        self._store.quotas.check(tenant, need)  # before moving anything for memory
        sent = sum(len(data) for _, data in chunks if data is not None)
        sent = sent if self._placed_in_memory else 0
        extra = len(r.window) if r.window is not None else 0

        def held() -> int:  # memory the spill's chunks named by key add, net of the old's
            by_key = sum(usage.memory_bytes(key) for key, data in chunks if data is None)
            if old is None:
                return by_key
            return by_key - sum(map(usage.memory_bytes, (*old.chunk_keys, old.window_key)))

        room = self._store.quotas.room(tenant, "memory_bytes")
        memory, start, keep_window = held() + sent + extra, 0, True
        if room is not None and memory > room and self._below is not None:
            store = self._store
            await demote_own(store.quotas.ledger, store.stack, store.locks, tenant,
                             memory - room, self._below,
                             {key for key, data in chunks if data is not None})
            room = self._store.quotas.room(tenant, "memory_bytes")
            memory = held() + sent + extra
            if room is not None and memory > room:
                memory, start, keep_window = held(), self._below, False
        return Admission(self._store.quotas.reserve(
            tenant, dataclasses.replace(need, memory_bytes=memory)), start, keep_window)

    async def _shed_retained(self, tenant: str, grows: int, keys: Sequence[str]) -> None:
        """The retained chunks of the tenant's own domain live in the room its
        ``durable_bytes`` quota leaves: free the least recently used ones that a spill
        growing the use by ``grows`` needs the room of (none of ``keys``, the spill's
        own, which it references again). Nothing is freed for a spill refused anyway."""
        room = self._store.quotas.room(tenant, "durable_bytes")
        if room is None or grows > room:
            return
        scope = dedupe_scope(tenant)
        own = set(keys)
        excess = (self._store.retention.bytes_of(scope) - sum(map(self._store.retention.size, own))
                  + max(0, grows) - room)
        if excess > 0:
            await self._store.blocks.free(self._store.retention.over_quota(scope, excess, own))

    def _retried(self, stored: SessionManifest) -> SessionManifest:
        """The answer to a retry of the spill that stored ``stored`` (as loaded: a window
        evicted since, or lost to a restart, is not named): the first attempt's counts,
        and where the session is held now, never where it was. ``durable`` stays the
        first answer's: a durable ack's generation stays durable, and a memory ack's
        retry promises nothing more."""
        assert stored.receipt is not None  # a stored spill's manifest has its receipt
        receipt = dataclasses.replace(
            stored.receipt, window_kept=stored.window_key is not None,
            tier=self._top_tier(stored.chunk_keys) or stored.window_tier or "")
        return stored.evolve(receipt=receipt)

    def _top_tier(self, keys: Sequence[str]) -> str:
        """The highest tier holding any of ``keys`` ("" when none is)."""
        tops = [holders[0] for holders in map(self._store.stack.holders, keys) if holders]
        return self._store.stack.tiers[min(tops)].name if tops else ""

    async def _store_window(self, key: str, data: Buffer, hint: ResumeHint | None
                            ) -> str | None:
        placed = await self._store.blocks.place_window(key, data, hint)
        if placed is None:
            self._store.stack.window_lost()
            log.warning("no window tier has room for %s (%d B): replay will be needed",
                        key, len(data))
            return None
        return self._store.stack.tiers[placed].name

    async def store_window(self, tenant: str, session_id: str, generation: int,
                           window: Buffer, *, replayed_tokens: int) -> str | None:
        """Keep a window rebuilt for the session as stored by a replay of
        ``replayed_tokens`` tokens, so the next resume need not replay again.

        Only the window changes: generation, token ids and chunks stay as they are. A
        partial window (a replay of fewer than ``min(W, num_tokens)`` tokens) is never
        kept. It replaces only a window of smaller ``window_coverage`` (a short replay
        never stands in for a longer one or the engine's own): one held here that covers as
        much stays, and its tier is returned; one in another node's memory (a fleet)
        stays named unless this one covers as much (then the session's window moves
        here). The blob lives in a window tier (hbm, host) or nowhere: returns the tier
        holding the session's window here, or None when none was kept here.
        ``StaleGeneration`` if the session was spilled again (or deleted and re-created)
        since ``generation``.
        """
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        async with self._store.catalog.write(tenant, session_id):
            manifest = await self._store.catalog.load_required(tenant, session_id)
            if manifest.generation != generation:
                raise StaleGeneration(f"{tenant}/{session_id} is at generation "
                                      f"{manifest.generation}, not {generation}: the "
                                      "rebuilt window belongs to an older state")
            spec = self._window_layout(manifest, "replayed_tokens", replayed_tokens, 1)
            check_window(spec, manifest.token_ids, window)
            n = manifest.num_tokens
            coverage = window_coverage(replayed_tokens, n)
            old = manifest.window_key
            held = old is not None and self._store.stack.holders(old)
            if held and manifest.window_coverage >= coverage:
                return manifest.window_tier  # as good or better already (another resume's)
            if not full_window(replayed_tokens, n, spec.window_tokens):
                # A partial window (fewer rows than a full one) is the Resume's answer,
                # never the session's: kept, a Restore would serve it as the window while
                # a Resume with a longer R rebuilds it. Without it, both say "replay".
                log.info("rebuilt window of %s/%s not kept: a replay of %d tokens is "
                         "partial (W = %d)", tenant, session_id, replayed_tokens,
                         spec.window_tokens)
                return None
            if manifest.remote_window is not None and manifest.window_coverage > coverage:
                log.info("rebuilt window of %s/%s not kept: node %s holds one of coverage "
                         "%d > %d", tenant, session_id, manifest.node_id,
                         manifest.window_coverage, coverage)
                return None
            tier = await self._name_window(manifest, window, replayed_tokens)
            key = self._window_key(manifest, replayed_tokens)
            if tier is not None and old is not None and old != key:
                await self._store.blocks.drop(old)
            return tier

    async def adopt_window(self, tenant: str, session_id: str, generation: int,
                           window: Buffer, *, replayed_tokens: int, from_node: str) -> str | None:
        """Keep the window another fleet node (``from_node``, draining) held of the session
        and name it this node's (``AdoptWindow``): the tier it went to, or None when no
        memory tier (or the tenant's ``memory_bytes``) had room for it.

        The session is the stored manifest's, never the sender's word alone: it must be
        at ``generation`` with its window in ``from_node``'s memory, and the window must
        be the layout's over the manifest's token ids (``check_window``), else
        ``StaleGeneration`` (the session moved on: left alone) or ``InvalidRequest``.
        Kept as a window this node rebuilt is (same tiers, same quota), and the manifest
        rewritten naming this node by compare-and-swap: a write another node made since
        the load is ``StaleGeneration`` and the adopted copy is dropped."""
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        async with self._store.catalog.write(tenant, session_id):
            manifest = await self._store.catalog.load_required(tenant, session_id)
            if (manifest.generation != generation or manifest.remote_window is None
                    or manifest.node_id != from_node):
                raise StaleGeneration(f"{tenant}/{session_id} does not hold a window of node "
                                      f"{from_node!r} at generation {generation} any more")
            spec = self._window_layout(manifest, "window_replayed", replayed_tokens, 0)
            try:
                check_window(spec, manifest.token_ids, window)
            except CodecError as exc:  # the sender's bytes, not a tier's copy
                raise InvalidRequest(f"the window is not one of {tenant}/{session_id}: "
                                     f"{exc}") from exc
            return await self._name_window(manifest, window, replayed_tokens)

    @staticmethod
    def _window_layout(manifest: SessionManifest, field: str, replayed_tokens: int,
                       lowest: int) -> LayoutSpec:
        """The session's layout, which must have window streams, with ``replayed_tokens``
        (the request's ``field``) in [``lowest``, the session's tokens]."""
        spec = get_layout(manifest.layout_id)
        if not spec.ephemeral_streams:
            raise InvalidRequest(f"layout {spec.layout_id} has no window streams")
        n = manifest.num_tokens
        if not isinstance(replayed_tokens, int) or not lowest <= replayed_tokens <= n:
            raise InvalidRequest(f"{field} must lie in [{lowest}, {n}] (the session's "
                                 f"tokens), got {replayed_tokens!r}")
        return spec

    @staticmethod
    def _window_key(manifest: SessionManifest, replayed_tokens: int) -> str:
        # its own key per replay length: the window it replaces stays readable until the
        # manifest names this one
        return (f"{WINDOW_PREFIX}{manifest.tenant}/{manifest.session_id}/"
                f"{manifest.generation}r{replayed_tokens}")

    async def _name_window(self, manifest: SessionManifest, window: Buffer,
                           replayed_tokens: int) -> str | None:
        """Keep ``window`` (rebuilt here, or adopted) as the session's, under the session's
        write lock, and commit ``manifest`` naming it on this node: the tier it went to, or
        None when no memory tier (or the tenant's ``memory_bytes``) had room."""
        key = self._window_key(manifest, replayed_tokens)
        await self._store.blocks.drop(key)  # a leftover copy must not stand in for this one
        tier = await self._store_rebuilt(manifest.tenant, manifest.session_id, key, window,
                                         manifest.hint)
        if tier is None:
            return None
        try:
            await self._store.catalog.put(manifest.evolve(
                window_tier=tier, window_key=key, window_replayed=replayed_tokens,
                remote_window=None))
        except BaseException:
            await self._store.blocks.drop(key)
            raise
        return tier

    async def _store_rebuilt(self, tenant: str, session_id: str, key: str, data: Buffer,
                             hint: ResumeHint | None) -> str | None:
        """``_store_window`` for a rebuilt window, admitted as memory the tenant holds
        (None, not kept, past ``memory_bytes``). The reservation covers the placement
        only: a window blob counts for its owner from the moment a memory tier holds it."""
        try:
            reservation = self._store.quotas.reserve(
                tenant, TenantUsage(memory_bytes=len(data)), count=False, what="window")
        except QuotaExceeded:
            self._store.stack.window_lost()
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
