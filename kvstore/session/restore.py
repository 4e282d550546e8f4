"""Restores: whole, streamed chunk by chunk, or delivered layer by layer; and prefetch.

    async with manager.reading(tenant, session_id) as reader:   # shares the session lock
        reader.manifest                                          # the snapshot being read
        async for chunk in reader.chunks():                      # in order, as they arrive
            ...
        window, tier = await reader.window()                     # None: replay is needed

``reader.layers()`` instead yields each (stream, layer) of the whole session as soon as
it is decoded, layer 0 of every stream first, so a worker can start on the first layer
before the last is ready. A reader holds the session's read lock, so a concurrent spill
of a newer generation waits: one reader never sees chunks of two generations.

``Restorer`` serves ``reading``, ``restore``, ``prefetch`` and ``read_chunk`` for the
manager. Each block comes from the highest tier holding an intact copy (see
``TierStack.read``); what was read below the top tier is promoted in the background.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvstore.format.checks import restored_chunk_check, window_check
from kvstore.format.chunk import LayerSlice, StreamData, decode_chunk
from kvstore.format.errors import DataLoss, InvalidRequest, SessionNotFound
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import get_layout
from kvstore.format.run_checks import restored_run_checks
from kvstore.placement.stack import Check, is_window_key
from kvstore.session.context import StoreContext
from kvstore.session.manifest import SessionManifest, check_name
from kvstore.tiers.base import Buffer


class ChunkBytes(NamedTuple):
    data: Buffer
    tier: str  # the name of the tier they were read from


READ_BATCH = 32  # chunks a streamed restore asks the tiers for at once
WHOLE_BATCH = 1024  # the same for a whole restore, which keeps every chunk anyway
# last_access (which TTLs count from) is rewritten at most this often: a manifest commit
# on every restore would cost a MetaStore write (an fsync on disk) per read.
ACCESS_PERSIST_S = 60.0


@dataclass(frozen=True)
class RestoredChunk:
    index: int
    key: str
    data: Buffer  # the encoded chunk, verified
    tier: str  # where it was read from


@dataclass(frozen=True)
class RestoreResult:
    manifest: SessionManifest
    chunks: list[Buffer]  # encoded chunks in order; the tail is manifest.tail
    chunk_tiers: list[str]
    window: Buffer | None
    window_tier: str | None
    replay_needed: bool  # the layout has window streams and no window blob came back


@dataclass(frozen=True)
class PrefetchResult:
    blocks: int  # chunks plus the window blob, if any
    promoted: int  # moved to a higher tier by this call
    complete: bool  # False when the timeout cut it short


class SessionReader:
    def __init__(self, restorer: Restorer, manifest: SessionManifest, spec: LayoutSpec) -> None:
        self._restorer = restorer
        self.manifest = manifest
        self.spec = spec
        # promotions made for this reader never evict the session's own blocks
        self.blocks = frozenset(manifest.chunk_keys) | (
            {manifest.window_key} if manifest.window_key else set())
        # (key, bytes, source tier, bad copies) of chunks read below the top tier, or
        # beside a bad copy: promoted once the reader is done, off the restore's path
        self.promotions: list[tuple[str, Buffer, int, list[int]]] = []

    async def chunks(self, lookahead: int | None = None, batch: int = READ_BATCH
                     ) -> AsyncIterator[RestoredChunk]:
        """Chunks in order, ``DataLoss`` if one is lost (saying so where the session's
        write-back failed). They are read in batches of
        ``batch`` (one ``TierStack.read_many`` each: the disk tier reads a batch in one
        go, and its checks run as one), with as many batches as ``lookahead`` chunks
        (default: the manager's ``config.restore_lookahead``) in flight beyond the one
        being yielded."""
        lookahead = lookahead or self._restorer.lookahead
        keys = self.manifest.chunk_keys
        starts = range(0, len(keys), batch)
        ahead = 1 + -(-max(1, lookahead) // batch)
        pending: collections.deque[asyncio.Future] = collections.deque()
        try:
            for at in starts:
                pending.append(asyncio.ensure_future(self._read(at, len(keys), batch)))
                if len(pending) < ahead and at + batch < len(keys):
                    continue
                for chunk in await pending.popleft():
                    yield chunk
            while pending:
                for chunk in await pending.popleft():
                    yield chunk
        finally:
            for task in pending:
                task.cancel()

    async def _read(self, at: int, end: int, batch: int) -> list[RestoredChunk]:
        indices = range(at, min(at + batch, end))
        keys = [self.manifest.chunk_keys[i] for i in indices]
        checks = restored_run_checks(self.spec, self.manifest.token_ids, at, keys)
        got = await self._restorer.read_blocks(keys, checks, self.blocks, self.promotions)
        out = []
        for i, key, value in zip(indices, keys, got, strict=True):
            if isinstance(value, DataLoss):
                m = self.manifest
                # a memory ack that did not survive, which Stat reported: say so
                why = (" (this generation was acked in memory and its write-back to a "
                       "durable tier failed)" if m.writeback_failed else "")
                raise DataLoss(f"{m.tenant}/{m.session_id} chunk {i}: {value}{why}") from value
            out.append(RestoredChunk(i, key, *value))
        return out

    async def window(self) -> tuple[Buffer | None, str | None]:
        """The window blob and the tier it came from, or (None, None): replay needed."""
        key = self.manifest.window_key
        if key is None:
            return None, None
        try:
            return await self._restorer.read_block(
                key, window_check(self.spec, self.manifest.token_ids), self.blocks,
                promote_now=True,
            )
        except DataLoss:
            return None, None

    async def layers(self, streams: Iterable[str] | None = None) -> AsyncIterator[LayerSlice]:
        """Every chosen persistent stream of the whole session (chunks + tail), layer-major."""
        buffers = [chunk.data async for chunk in self.chunks()]
        if self.manifest.tail:
            buffers.append(self.manifest.tail)
        chosen = [s for s in self.spec.persistent_streams if streams is None or s.name in streams]
        for layer in range(max((s.layers for s in chosen), default=0)):
            for stream in (s for s in chosen if s.layers > layer):
                data = await asyncio.to_thread(self._decode_layer, buffers, stream.name, layer)
                yield LayerSlice(stream.name, layer, data)

    def _decode_layer(self, buffers: list[Buffer], stream: str, layer: int) -> StreamData:
        parts = [
            decode_chunk(buf, self.spec, streams=[stream], layers=[layer]).streams[stream]
            for buf in buffers
        ]
        # each part: codes (1, entries_i, ...) -> joined along entries, layer axis dropped
        codes = torch.cat([p.codes for p in parts], dim=1)[0]
        scales = None
        if parts and parts[0].scales is not None:
            scales = torch.cat([p.scales for p in parts if p.scales is not None], dim=1)[0]
        return StreamData(codes, scales)


class Restorer:
    def __init__(self, store: StoreContext, *, lookahead: int) -> None:
        """``lookahead``: chunks a streamed restore fetches ahead by default. Promotions
        and access times run in the background (``store.spawn``)."""
        self._store = store
        self.lookahead = lookahead

    @asynccontextmanager
    async def reading(self, tenant: str, session_id: str) -> AsyncIterator[SessionReader]:
        check_name("tenant", tenant)
        check_name("session_id", session_id)
        async with self._store.catalog.read(tenant, session_id):
            manifest = await self._store.catalog.load_required(tenant, session_id)
            if manifest.expired():
                raise SessionNotFound(f"session {tenant}/{session_id} has expired")
            reader = SessionReader(self, manifest, get_layout(manifest.layout_id))
            try:
                yield reader
            finally:
                if reader.promotions:
                    self._store.spawn(self.promote_all(reader.promotions, reader.blocks))
        self._store.counters.restores += 1
        if time.time() - manifest.last_access > ACCESS_PERSIST_S:
            self._store.spawn(self._note_access(tenant, session_id, manifest.generation))

    async def restore(self, tenant: str, session_id: str, *, want_window: bool = True
                      ) -> RestoreResult:
        """The whole session: every chunk verified, the window blob if it is still held."""
        async with self.reading(tenant, session_id) as reader:
            count = len(reader.manifest.chunk_keys)  # all in flight: nothing waits on them
            chunks = [chunk async for chunk in reader.chunks(count, WHOLE_BATCH)]
            window, window_tier = await reader.window() if want_window else (None, None)
            manifest = reader.manifest
            has_window_streams = bool(reader.spec.ephemeral_streams)
        key = manifest.window_key
        held = key is not None and bool(self._store.stack.holders(key))
        available = window is not None if want_window else held
        return RestoreResult(
            manifest=manifest,
            chunks=[c.data for c in chunks],
            chunk_tiers=[c.tier for c in chunks],
            window=window,
            window_tier=window_tier,
            replay_needed=has_window_streams and not available,
        )

    async def prefetch(self, tenant: str, session_id: str, timeout_s: float) -> PrefetchResult:
        """Promote a session's blocks toward the top tier before it resumes, within
        ``timeout_s``; what is done by then stays done."""
        promoted = 0
        blocks = 0

        async def lift(key: str, check, protect: frozenset[str]) -> None:
            nonlocal promoted
            holders = self._store.stack.holders(key)
            if holders and holders[0] == 0:
                return
            try:
                data, source, bad = await self._store.stack.read(key, check)
            except DataLoss:
                if is_window_key(key):
                    return  # evicted since the manifest was read: a restore will replay
                raise
            async with self._store.locks.hold(key):
                target = await self._store.stack.promote(key, data, source, bad, protect)
            promoted += target is not None and target < source

        try:
            async with asyncio.timeout(timeout_s), self.reading(tenant, session_id) as reader:
                m = reader.manifest
                work = [
                    lift(key, restored_chunk_check(reader.spec, m.token_ids, i, key),
                         reader.blocks)
                    for i, key in enumerate(m.chunk_keys)
                ]
                if m.window_key is not None:
                    check = window_check(reader.spec, m.token_ids)
                    work.append(lift(m.window_key, check, reader.blocks))
                blocks = len(work)
                await self._store.blocks.gather(work)
        except TimeoutError:
            return PrefetchResult(blocks, promoted, complete=False)
        return PrefetchResult(blocks, promoted, complete=True)

    async def read_chunk(self, manifest: SessionManifest, index: int) -> ChunkBytes:
        """See ``TierManager.read_chunk``: an internal read, not counted, not promoted."""
        if not 0 <= index < len(manifest.chunk_keys):
            raise InvalidRequest(f"chunk index {index} out of range "
                                 f"({len(manifest.chunk_keys)} chunks)")
        key = manifest.chunk_keys[index]
        check = restored_chunk_check(get_layout(manifest.layout_id), manifest.token_ids, index,
                                     key)
        data, source, _ = await self._store.stack.read(key, check, access=False)
        return ChunkBytes(data, self._store.stack.tiers[source].name)

    async def read_block(self, key: str, check: Check, protect: frozenset[str], *,
                          promote_now: bool = False) -> ChunkBytes:
        data, source, bad = await self._store.stack.read(key, check)
        if source > 0 or bad:
            promotion = self._promote(key, data, source, bad, protect)
            if promote_now:
                await promotion
            else:
                self._store.spawn(promotion)
        return ChunkBytes(data, self._store.stack.tiers[source].name)

    async def read_blocks(self, keys: list[str], checks: Sequence[Check], protect: frozenset[str],
                          promotions: list) -> list[tuple[Buffer, str] | DataLoss]:
        """``read_block`` of each key (its DataLoss in its place), the promotions left
        in ``promotions`` for the caller to make."""
        out: list[tuple[Buffer, str] | DataLoss] = []
        for key, got in zip(keys, await self._store.stack.read_many(keys, checks), strict=True):
            if isinstance(got, DataLoss):
                out.append(got)
                continue
            data, source, bad = got
            if source > 0 or bad:
                promotions.append((key, data, source, bad))
            out.append((data, self._store.stack.tiers[source].name))
        return out

    async def promote_all(self, promotions: list, protect: frozenset[str]) -> None:
        """Make the promotions ``read_blocks`` left, never evicting one of ``protect``."""
        for key, data, source, bad in promotions:
            await self._promote(key, data, source, bad, protect)

    async def _promote(self, key: str, data: Buffer, source: int, bad: list[int],
                       protect: frozenset[str]) -> None:
        async with self._store.locks.hold(key):
            if is_window_key(key) or self._store.ledger.count(key):  # not freed since the read
                await self._store.stack.promote(key, data, source, bad, protect)
            else:  # another node's session (counts are per node): Redis keeps it for all
                await self._store.stack.share(key, data, stop=source, protect=protect)

    async def _note_access(self, tenant: str, session_id: str, generation: int) -> None:
        async with self._store.catalog.write(tenant, session_id):
            with contextlib.suppress(DataLoss):  # a corrupt manifest is reported elsewhere
                manifest = await self._store.catalog.load(tenant, session_id)
                if manifest is not None and manifest.generation == generation:
                    await self._store.catalog.put(manifest.evolve(last_access=time.time()))
