"""Prefix chunks of no session: the chunks of a token prefix stored as cache
(``write``) and read back by their position in the sequence (``read``).

Keys are computed here, never taken from the caller: chunk ``i``'s chain key chains
from token 0 in the caller's dedupe domain (``kvstore.format.keys``), so a call reads or
writes only its own domain's chunks, and a session spilled with those tokens shares them
(a written chunk is what a spill naming its block key dedupes against, and a session's
chunk is readable here). With ``independent`` each whole chunk is keyed and checked alone,
as the first chunk of a sequence of its own tokens (proto "Independent chunks"): many
unrelated chunks in one call, each the very chunk a one-chunk call of its tokens stores.
Rules:

- Written chunks are checked as a spill's (``kvstore.format.checks.check_chunk``) and
  kept as retained cache entries (``kvstore.prefix.chains.Retention``), their marks
  persisted (``RefLedger.mark_retained``): evictable first, freed idle past
  ``retain_ttl_s``. With retention off a write is refused (``PreconditionFailed``): its
  chunks would be freed at once.
- Quotas (``kvstore.session.quota``): retained chunks are no session's, so they count in
  no ``durable_bytes`` or ``memory_bytes`` use; the tenant's own domain's live in the room
  its ``durable_bytes`` limit leaves. A write reserves its sent bytes there while it
  runs (``QuotaExceeded`` if they alone do not fit) and frees the least recently used
  retained chunks of the domain that the room needs first. Past the tenant's
  ``memory_bytes`` room the chunks start below the memory tiers. A shared domain's count
  against no tenant's quota.
- Chunks are admitted as a spill's, through ``Blocks.admitting`` (the encrypting
  tiers learn their domain there).
- Acks as a spill's: "memory" once every chunk is in some tier (queued for write-back
  to a durable one, ``WriteBack`` of no session); "durable" once each is on a durable
  tier and its mark committed (a chunk whose durable copy failed is not kept
  anywhere: ``Blocks.store``).
- A read never fails for one chunk: a chunk held nowhere intact, or not of the expected
  digest, comes back with the reason (``MISSING_REASONS``) and the others are read.
  Reads count and promote as a restore's (``Restorer.read_blocks``) and make retained
  chunks recent. In a fleet, chain keys this node does not know are asked of the shared
  tiers (``TierStack.find_chains``), and a read tries every tier.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvstore.format.checks import check_chunk, check_token_ids, restored_chunk_check
from kvstore.format.errors import (
    ChunksNotHeld,
    DataLoss,
    InvalidRequest,
    PreconditionFailed,
)
from kvstore.format.hints import ResumeHint
from kvstore.format.keys import (
    DIGEST_BYTES,
    block_key,
    check_fingerprint,
    chunk_tokens_of,
    dedupe_scope,
    independent_keys,
    iter_chain_keys,
    split_block_key,
    token_bytes,
)
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import get_layout
from kvstore.format.run_checks import RunCheck, RunMember
from kvstore.placement.blocks import BlockWrite, ChunkOutcome
from kvstore.placement.writeback import WriteBack
from kvstore.session.context import StoreContext
from kvstore.session.manifest import check_name
from kvstore.session.quota import Reservation, TenantUsage, memory_floor
from kvstore.session.restore import Restorer
from kvstore.tiers.base import Buffer

MISSING_REASONS = ("not_held", "corrupt", "digest_mismatch", "tier_unavailable")
HASH_ON_LOOP_CHUNKS = 64  # chain keys hashed on the event loop at most (about 1 ms)
CHECK_ON_LOOP_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ChunkWrite:
    """Whole chunks of ``token_ids`` from ``first_chunk`` on: ``digests``, one per chunk
    from there, of its encoded bytes; ``chunks``: index in the sequence -> bytes, for
    those sent (the others are named by key: confirmed held, unread, or
    ``ChunksNotHeld``); ``dedupe_domain``: a shared domain the caller may use, None for
    the tenant's own; ``independent``: each chunk keyed alone (module docstring)."""

    tenant: str
    layout_id: str
    token_ids: Sequence[int] | np.ndarray
    first_chunk: int
    digests: Sequence[bytes]
    chunks: Mapping[int, Buffer]
    model_fingerprint: str = ""
    dedupe_domain: str | None = None
    ack: Literal["memory", "durable"] = "memory"
    hint: ResumeHint | None = None
    independent: bool = False


@dataclass(frozen=True)
class ChunksWritten:
    chain_keys: tuple[str, ...]  # of the chunks from first_chunk on
    written: int
    deduped: int  # some tier held that key with that digest already
    tier: str  # the highest tier holding any of them
    durable: bool


@dataclass(frozen=True)
class ChunkRead:
    """One chunk's answer: its bytes (verified) and tier, or why there are none."""

    index: int  # in the sequence
    chain_key: str
    data: Buffer | None
    digest: bytes  # of ``data``; b"" when missing
    tier: str = ""
    missing: str = ""  # one of MISSING_REASONS, "" when read


class PrefixChunks:
    def __init__(self, store: StoreContext, restorer: Restorer, *, durable_meta: bool) -> None:
        """``durable_meta``: whether marks survive a restart (a durable ack needs it)."""
        self._store = store
        self._restorer = restorer
        self._can_ack_durable = durable_meta and bool(store.blocks.durable)
        self._below = memory_floor(store.stack)

    async def write(self, r: ChunkWrite) -> ChunksWritten:  # noqa: C901 - a prefix-chunk write's checks in the order the proto states them
        """Store the chunks as retained cache entries (module docstring)."""
        store = self._store
        if not store.retention.enabled:
            raise PreconditionFailed("this server keeps no unreferenced chunks "
                                     "(retain_unreferenced is off): prefix chunks written "
                                     "without a session would be freed at once")
        if r.ack not in ("memory", "durable"):
            raise InvalidRequest(f"ack must be 'memory' or 'durable', got {r.ack!r}")
        if r.ack == "durable" and not self._can_ack_durable:
            raise InvalidRequest("a durable ack needs a durable tier and a durable MetaStore")
        spec, tokens, scope, chains = await self._chains(
            r.tenant, r.layout_id, r.token_ids, r.model_fingerprint, r.dedupe_domain,
            whole=True, independent=r.independent)
        first = r.first_chunk
        if not isinstance(first, int) or not 0 <= first <= len(chains):
            raise InvalidRequest(f"first_chunk {first!r} is not in [0, {len(chains)}] (the "
                                 "whole chunks of token_ids)")
        if len(r.digests) != len(chains) - first:
            raise InvalidRequest(f"{len(chains) - first} chunks from first_chunk {first} need "
                                 f"one digest each; {len(r.digests)} were given")
        if any(not isinstance(d, bytes) or len(d) != DIGEST_BYTES for d in r.digests):
            raise InvalidRequest(f"a chunk digest is {DIGEST_BYTES} bytes (BLAKE2b-256)")
        outside = sorted(i for i in r.chunks if not first <= i < len(chains))
        if outside:
            raise InvalidRequest(f"chunk {outside[0]} is not one of chunks {first}.."
                                 f"{len(chains) - 1}")
        if len(set(chains[first:])) < len(chains) - first:
            raise InvalidRequest("two independent chunks have the same tokens: write each "
                                 "chunk once")
        keys = [block_key(chains[first + i], d) for i, d in enumerate(r.digests)]

        def checked() -> None:
            for i, data in r.chunks.items():
                check_chunk(spec, *chunk_tokens_of(tokens, i, spec.chunk_tokens, r.independent),
                            r.digests[i - first], data)

        sent = sum(len(data) for data in r.chunks.values())
        if sent > CHECK_ON_LOOP_BYTES:  # every byte is hashed: off the event loop
            await asyncio.to_thread(checked)
        else:
            checked()
        own = r.dedupe_domain is None
        with store.blocks.admitting(BlockWrite(scope, spec.layout_hash, tuple(keys))):
            with await self._admit(r.tenant, scope, sent, keys, own) as admitted:
                outcomes, sizes = await self._place(spec, tokens, r, keys, admitted)
            for key, outcome in zip(keys, outcomes, strict=True):
                if outcome.needs_writeback:
                    await store.durability.queue.submit(WriteBack(key, r.tenant, "", 0))
        tops = [holders[0] for holders in map(store.stack.holders, keys) if holders]
        deduped = sum(outcome.held for outcome in outcomes)
        return ChunksWritten(tuple(chains[first:]), len(keys) - deduped, deduped,
                             store.stack.tiers[min(tops)].name if tops else "",
                             r.ack == "durable")

    async def _admit(self, tenant: str, scope: str, sent: int, keys: Sequence[str],
                     own: bool) -> _Admitted:
        """The write's reservation of ``durable_bytes`` room (its own domain's only), room
        made by freeing the domain's least recently used retained chunks, and the tier
        its chunks start at."""
        store = self._store
        start = 0
        memory = store.quotas.room(tenant, "memory_bytes")
        if memory is not None and sent > memory and self._below is not None:
            start = self._below
        if not own:
            return _Admitted(None, start)
        reservation = store.quotas.reserve(tenant, TenantUsage(durable_bytes=sent),
                                           what="WriteChunks")
        room = store.quotas.room(tenant, "durable_bytes")
        if room is not None:
            mine = set(keys)
            excess = (store.retention.bytes_of(scope) - sum(map(store.retention.size, mine))
                      - room)  # the room left after this write's reservation
            if excess > 0:
                try:
                    await store.blocks.free(store.retention.over_quota(scope, excess, mine))
                except BaseException:
                    reservation.release()
                    raise
        return _Admitted(reservation, start)

    async def _place(self, spec: LayoutSpec, tokens: np.ndarray, r: ChunkWrite,
                     keys: Sequence[str], admitted: _Admitted
                     ) -> tuple[list[ChunkOutcome], dict[str, int]]:
        """Place the sent chunks and confirm the others, pinned meanwhile, then leave
        them to retention with their marks; each chunk's outcome and size."""
        store, first = self._store, r.first_chunk
        durable = r.ack == "durable"
        protect = frozenset(keys)
        scope = dedupe_scope(r.tenant, r.dedupe_domain)
        by_key = [i for i in range(len(keys)) if first + i not in r.chunks]
        sizes: dict[str, int] = {}
        store.ledger.pin(keys)
        try:
            found = await store.blocks.gather(
                store.blocks.reference(keys[i], store.index.size(keys[i]) or None,
                                       restored_chunk_check(spec, *chunk_tokens_of(
                                           tokens, first + i, spec.chunk_tokens,
                                           r.independent), keys[i]),
                                       r.hint, durable_ack=durable) for i in by_key)
            missing = [first + i for i, got in zip(by_key, found, strict=True) if got is None]
            if missing:
                raise ChunksNotHeld(missing)
            sent = [i for i in range(len(keys)) if first + i in r.chunks]
            stored = await store.blocks.gather(
                store.blocks.store(keys[i], r.chunks[first + i], r.hint, protect,
                                   admitted.start, durable_ack=durable) for i in sent)
            outcomes = dict(zip(by_key, found, strict=True)) | dict(zip(sent, stored,
                                                                        strict=True))
            sizes = {keys[i]: outcome.size for i, outcome in outcomes.items()}
            await store.ledger.mark_retained(store.retention.marks(
                list(sizes), list(sizes.values()), scope))
        finally:
            await store.blocks.release(store.ledger.unpin(keys), scope, sizes)
        return [outcomes[i] for i in range(len(keys))], sizes

    async def read(self, tenant: str, layout_id: str, token_ids: Sequence[int] | np.ndarray,  # noqa: C901 - a prefix-chunk read's checks in the order the proto states them
                   *, first_chunk: int, count: int, digests: Sequence[bytes] = (),
                   model_fingerprint: str = "", dedupe_domain: str | None = None,
                   independent: bool = False) -> list[ChunkRead]:
        """Chunks ``first_chunk`` .. ``first_chunk + count - 1`` of ``token_ids``, in order,
        each read or missing with its reason; ``digests`` (one per chunk, or none): the
        bytes expected (only another version held: ``digest_mismatch``); ``independent``:
        each chunk keyed alone (module docstring)."""
        if digests and len(digests) != count:
            raise InvalidRequest(f"{len(digests)} expected digests for {count} chunks: give "
                                 "one per chunk read, or none")
        if any(not isinstance(d, bytes) or len(d) != DIGEST_BYTES for d in digests):
            raise InvalidRequest(f"a chunk digest is {DIGEST_BYTES} bytes (BLAKE2b-256)")
        spec, tokens, _, chains = await self._chains(
            tenant, layout_id, token_ids, model_fingerprint, dedupe_domain, whole=False,
            upto=first_chunk + count, independent=independent)
        if first_chunk < 0 or count < 0 or first_chunk + count > len(chains):
            raise InvalidRequest(f"chunks {first_chunk}..{first_chunk + count - 1} are not "
                                 f"whole chunks of token_ids ({len(tokens)} tokens)")
        chains = chains[first_chunk:]
        await self._learn(chains)
        keys: dict[int, str] = {}  # position in chains -> block key to read
        missing: dict[int, str] = {}
        for n, chain in enumerate(chains):
            versions = self._store.index.blocks(chain)
            if not versions:
                missing[n] = "not_held"
            elif not digests:
                keys[n] = self._version(versions)
            elif block_key(chain, digests[n]) in versions:
                keys[n] = block_key(chain, digests[n])
            else:
                missing[n] = "digest_mismatch"  # held, with other bytes than expected
        counters = self._store.counters
        counters.lookups += len(missing)  # asked and missed, like a read no tier answers
        counters.misses += len(missing)
        wanted = sorted(keys)
        # one check of the batch: its headers compared in a few numpy calls, not one by one
        run = RunCheck(spec, tokens, first_chunk, [keys.get(n) for n in range(len(chains))],
                       independent)
        checks = [RunMember(run, first_chunk + n) for n in wanted]
        promotions: list = []
        got = await self._restorer.read_blocks([keys[n] for n in wanted], checks,
                                               frozenset(), promotions)
        if promotions:
            self._store.spawn(self._restorer.promote_all(promotions, frozenset()))
        answers = dict(zip(wanted, got, strict=True))
        self._store.retention.touch(keys[n] for n in wanted
                                    if not isinstance(answers[n], DataLoss))
        out = []
        for n, chain in enumerate(chains):
            index, value = first_chunk + n, answers.get(n)
            if value is None or isinstance(value, DataLoss):
                out.append(ChunkRead(index, chain, None, b"",
                                     missing=missing.get(n) or _reason(value)))
            else:
                out.append(ChunkRead(index, chain, value[0], split_block_key(keys[n])[1],
                                     value[1]))
        return out

    def _version(self, versions: Mapping[str, Collection[int]]) -> str:
        """The version of a chunk to read of those some tier is believed to hold: the
        referenced one (a live session vouches for it), then the one held highest (as
        ``kvstore.prefix.chains.longest_prefix`` names it)."""
        if len(versions) == 1:  # the usual case: no choice to make
            return next(iter(versions))
        referenced = self._store.ledger.count
        return min(versions, key=lambda k: (not referenced(k), min(versions[k]), k))

    async def _learn(self, chains: Sequence[str]) -> None:
        """In a fleet: ask the shared tiers (Redis, then the bucket) about the chain keys
        this node knows no version of, and learn what they hold."""
        for j in self._store.stack.shared_tiers():
            unknown = [chain for chain in chains if not self._store.index.blocks(chain)]
            if not unknown:
                return
            await self._store.stack.find_chains(j, unknown)

    async def _chains(self, tenant: str, layout_id: str,
                      token_ids: Sequence[int] | np.ndarray, model_fingerprint: str,
                      dedupe_domain: str | None, *, whole: bool, upto: int | None = None,
                      independent: bool = False
                      ) -> tuple[LayoutSpec, np.ndarray, str, list[str]]:
        """(layout, tokens, scope, chain keys of the first ``upto`` whole chunks, or all);
        ``whole``: a partial last chunk is refused; ``independent``: each keyed alone."""
        check_name("tenant", tenant)
        spec = get_layout(layout_id)
        tokens = np.frombuffer(token_bytes(token_ids), dtype="<u4")
        fingerprint = check_fingerprint(model_fingerprint)
        if spec.requires_model_fingerprint and not fingerprint:
            raise InvalidRequest(f"layout {spec.layout_id} requires a model fingerprint "
                                 "(the weights/version id of the model whose KV this is)")
        check_token_ids(spec, tokens)
        size = spec.chunk_tokens
        if whole and len(tokens) % size:
            raise InvalidRequest(f"{len(tokens)} tokens are not whole chunks of {size}: only "
                                 f"whole chunks are stored ({len(tokens) % size} tokens past "
                                 "the last)")
        scope = dedupe_scope(tenant, dedupe_domain)
        wanted = len(tokens) // size if upto is None else min(upto, len(tokens) // size)

        def hashed() -> list[str]:
            if independent:
                return independent_keys(spec.layout_id, tokens[:wanted * size], size,
                                        scope=scope, model_fingerprint=fingerprint)
            return list(itertools.islice(iter_chain_keys(
                spec.layout_id, tokens, size, scope=scope, model_fingerprint=fingerprint),
                wanted))

        chains = (await asyncio.to_thread(hashed) if wanted > HASH_ON_LOOP_CHUNKS
                  else hashed())
        return spec, tokens, scope, chains


@dataclass
class _Admitted:
    reservation: Reservation | None  # released when the write ended
    start: int  # the first tier its sent chunks may take

    def __enter__(self) -> _Admitted:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.reservation is not None:
            self.reservation.release()


def _reason(loss: DataLoss | None) -> str:
    """Why a read found no intact copy (None: it was not asked for)."""
    if loss is None:
        return "not_held"
    if loss.corrupt:
        return "corrupt"
    return "tier_unavailable" if loss.unavailable else "not_held"
