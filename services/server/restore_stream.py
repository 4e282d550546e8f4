"""The Restore and Resume reply streams.

Order: one ``SessionHeader``; then either every chunk in order (``RestoredChunk``) and
the tail, or, layer by layer, every (stream, layer) of every chunk and the tail as
``LayerSection``s with layer 0 of every stream first, so a worker can start before the
last layer arrives (``kvstore.format.layer_sections``: the order, the chunk tables the
header then carries, and the tail's sections with ``chunk_index == len(chunk_keys)``);
then the window, if asked for and held (or rebuilt by Resume); then a ``ResumeSummary``.
The header states the digest of a held window it carries; the summary that of a window
the Resume rebuilt.

The header carries the session's model fingerprint; a caller that stated another one
gets ``ModelMismatch`` before any byte, and a replay runs only on weights of the
session's fingerprint (the replay worker checks it against its own: ``ModelMismatch``).

The header states how a held window was made (``window_replayed_tokens``: 0 for the
engine's own, else the tokens of the replay that built it). Whether a call sends the held
window, replays (with what R) and keeps the rebuilt window is the store's plan
(``kvstore.session.resume.plan_window``); these generators only frame its replies.

Each block comes from the highest tier holding an intact copy (verified by the manager);
no tier with an intact copy raises ``DataLoss`` before any byte of that block is sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore.format.chunk import DecodedChunk, decode_chunk, max_encoded_bytes
from kvstore.format.errors import (
    KVTierError,
    LayoutMismatch,
    MessageTooLarge,
    ReplayUnavailable,
    SharedMemoryExhausted,
)
from kvstore.format.keys import chunk_digest, shared_domain, split_block_key
from kvstore.format.layer_sections import EMPTY_XXH3, chunk_table, section_order
from kvstore.format.layout import LayoutSpec
from kvstore.format.model_identity import check_model
from kvstore.session.manager import TierManager
from kvstore.session.manifest import SessionManifest
from kvstore.session.restore import RestoredChunk, SessionReader
from kvstore.session.resume import ResumePlan, plan_window
from kvstore.tiers.base import Buffer
from kvtier.shm import PackedWriter
from proto import kvtier_pb2 as pb
from services.server import requests
from services.server.metrics import ServiceMetrics
from services.server.replay_backend import ReplayBackend
from services.server.shm_leases import Lease, LeaseTable

if TYPE_CHECKING:
    from replay.worker import ReplayResult

MESSAGE_MARGIN = 4096  # room for the fields around one payload in a reply


log = logging.getLogger(__name__)


@dataclass
class StreamOptions:
    layer_by_layer: bool = False  # Restore only
    want_window: bool = False  # Restore only: a Resume always asks for the window
    use_shared_memory: bool = False
    reply_lease: str = ""  # a shared memory lease of the caller's, offered to write into
    peer: str = ""  # the caller's connection: whose leases these are
    replay_tokens: int = 0  # Resume only: R asked for; 0: the plan's default
    model_fingerprint: str = ""  # the caller's model; "": not checked


@dataclass
class _Reply:
    """One call's reply as it is framed: where its payloads go (a reply segment's writer,
    or inline, with why no segment was leased) and the tiers its blocks came from."""

    writer: PackedWriter | None
    refused: str
    chains: list[str]  # each chunk's chain key, as the header states it
    tiers: set[str] = field(default_factory=set)


class RestoreStreamer:
    def __init__(self, manager: TierManager, metrics: ServiceMetrics,
                 leases: LeaseTable | None,
                 replay: Callable[[], tuple[ReplayBackend | None, str]],
                 max_message_bytes: int, replayers: frozenset[str] = frozenset(), *,
                 default_replay_tokens: int) -> None:
        self.manager = manager
        self.replayers = replayers  # the layouts' replayers the backend runs
        self.metrics = metrics
        self.leases = leases
        self.replay = replay
        self.max_payload = max_message_bytes - MESSAGE_MARGIN
        self.default_replay_tokens = default_replay_tokens  # R where nothing states one

    async def restore(self, tenant: str, session_id: str, opts: StreamOptions
                      ) -> AsyncIterator[pb.RestoreReply]:
        """A Restore's replies: the header, every chunk (or layer section) and the tail,
        the held window if asked for, the summary."""
        started = time.perf_counter()
        lease = None
        try:
            async with self.manager.reading(tenant, session_id) as reader:
                m = reader.manifest
                plan = await self._plan(reader, opts, resume=False)
                lease, reply = self._begin(reader, opts, plan)
                if opts.layer_by_layer:  # the header carries every chunk's table
                    chunks = [chunk async for chunk in reader.chunks()]
                    reply.tiers.update(chunk.tier for chunk in chunks)
                    buffers = [chunk.data for chunk in chunks] + ([m.tail] if m.tail else [])
                    yield self._header(reader, plan, reply, lease,
                                       [chunk_table(buf) for buf in buffers])
                    async for section in self._sections(reader.spec, buffers):
                        yield pb.RestoreReply(section=section)
                else:
                    yield self._header(reader, plan, reply, lease)
                    async for chunk in reader.chunks():
                        yield self._chunk(chunk, reply)
                    if m.tail:
                        yield pb.RestoreReply(tail=self.payload("", m.tail, reply.writer,
                                                                reply.refused))
                if plan.window is not None:
                    yield pb.RestoreReply(window=self.payload("", plan.window, reply.writer,
                                                              reply.refused))
            yield pb.RestoreReply(summary=self._summary(started, reply, plan))
        finally:
            if lease is not None and self.leases is not None:  # renewed: the client copies
                self.leases.done(lease)  # out, then may offer it again

    async def resume(self, tenant: str, session_id: str, opts: StreamOptions
                     ) -> AsyncIterator[pb.RestoreReply]:
        """A Resume's replies: the header, every chunk and the tail, the held window or
        the one its replay rebuilds (then kept, as the plan says), the summary."""
        started = time.perf_counter()
        lease, rebuilding = None, None
        try:
            async with self.manager.reading(tenant, session_id) as reader:
                m, spec = reader.manifest, reader.spec
                plan = await self._plan(reader, opts, resume=True)
                backend = self._backend(f"{tenant}/{session_id}", spec) if plan.replay else None
                lease, reply = self._begin(reader, opts, plan)
                yield self._header(reader, plan, reply, lease)
                chunks = reader.chunks()
                if backend is not None:
                    # Every chunk read first, so the replay (in its worker thread) runs
                    # while they are sent: the client receives during the replay.
                    read = [chunk async for chunk in chunks]
                    rebuilding = asyncio.ensure_future(backend.rebuild(
                        spec, m.token_ids, [chunk.data for chunk in read], m.tail,
                        plan.replay_tokens, model_fingerprint=m.model_fingerprint))
                    chunks = _already_read(read)
                async for chunk in chunks:
                    yield self._chunk(chunk, reply)
                if m.tail:
                    yield pb.RestoreReply(tail=self.payload("", m.tail, reply.writer,
                                                            reply.refused))
                if plan.window is not None:
                    yield pb.RestoreReply(window=self.payload("", plan.window, reply.writer,
                                                              reply.refused))
            summary = self._summary(started, reply, plan)
            if rebuilding is not None:
                async for window in self._rebuilt_window(m, spec, plan, rebuilding, reply,
                                                         summary):
                    yield window
            self.metrics.resume_seconds.labels(summary.tier or "none").observe(
                time.perf_counter() - started)
            yield pb.RestoreReply(summary=summary)
        finally:
            if rebuilding is not None:  # the call may have ended before the replay did
                _settle(rebuilding)
            if lease is not None and self.leases is not None:
                self.leases.done(lease)

    async def _rebuilt_window(self, m: SessionManifest, spec: LayoutSpec, plan: ResumePlan,
                              rebuilding: asyncio.Future, reply: _Reply,
                              summary: pb.ResumeSummary) -> AsyncIterator[pb.RestoreReply]:
        """The window the replay rebuilds, once it is done (it began during the send),
        then kept as the plan says; the summary states it."""
        session = f"{m.tenant}/{m.session_id}"
        with requests.phase("replay"):  # the wait for the replay (a failed one too)
            rebuilt = await self._rebuilt(session, spec, rebuilding)
        yield pb.RestoreReply(window=self.payload("", rebuilt.window, reply.writer))
        if plan.keep_window:
            await self._keep_window(m.tenant, m.session_id, m.generation, rebuilt.window,
                                    rebuilt.replayed_tokens)
        summary.replayed = True
        summary.replay_tokens = rebuilt.replayed_tokens
        summary.replay_seconds = rebuilt.seconds
        summary.window_digest = chunk_digest(rebuilt.window)

    async def _plan(self, reader: SessionReader, opts: StreamOptions, *, resume: bool
                    ) -> ResumePlan:
        """The store's plan for this call's window, once the caller's model is checked."""
        m = reader.manifest
        check_model(opts.model_fingerprint, m.model_fingerprint, f"{m.tenant}/{m.session_id}")
        backend, _ = self.replay()
        return await plan_window(reader, resume=resume, want_window=opts.want_window,
                                 replay_tokens=opts.replay_tokens,
                                 can_replay=self._replayable(reader.spec, backend),
                                 default_replay_tokens=self.default_replay_tokens)

    def _begin(self, reader: SessionReader, opts: StreamOptions, plan: ResumePlan
               ) -> tuple[Lease | None, _Reply]:
        """The reply segment for every byte this call may send (a window it rebuilds
        included), and the reply's framing state."""
        m = reader.manifest
        size = sum(m.chunk_sizes) + len(m.tail) + (len(plan.window) if plan.window else 0)
        if plan.replay:  # the rebuilt window goes in the segment too
            size += _window_bound(reader.spec)
        lease, writer, refused = self.reply_segment(opts, size)
        requests.note(bytes=size, generation=m.generation)
        return lease, _Reply(writer, refused, [split_block_key(key)[0] for key in m.chunk_keys])

    def _header(self, reader: SessionReader, plan: ResumePlan, reply: _Reply,
                lease: Lease | None, tables: list[bytes] | None = None) -> pb.RestoreReply:
        """The session header: every field that states stored state computed from the
        manifest and the window as read."""
        m = reader.manifest
        return pb.RestoreReply(header=pb.SessionHeader(
            layout_id=m.layout_id, generation=m.generation, num_tokens=m.num_tokens,
            token_ids=m.token_ids.tobytes(), chunk_keys=reply.chains,
            chunk_digests=[split_block_key(key)[1] for key in m.chunk_keys],
            tail_digest=chunk_digest(m.tail) if m.tail else b"",
            model_fingerprint=m.model_fingerprint,
            dedupe_domain=shared_domain(m.dedupe_scope),
            window_available=plan.window_held, replay_needed=plan.replay_needed,
            window_replayed_tokens=m.window_replayed if plan.window_held else 0,
            window_tier=plan.window_tier or "",
            window_digest=chunk_digest(plan.window) if plan.window is not None else b"",
            chunk_tables=tables or [],
            writeback_failed=m.writeback_failed,
            reply_segment=(self.leases.describe(lease)
                           if lease is not None and self.leases is not None else None)))

    def _chunk(self, chunk: RestoredChunk, reply: _Reply) -> pb.RestoreReply:
        reply.tiers.add(chunk.tier)
        return pb.RestoreReply(chunk=pb.RestoredChunk(
            index=chunk.index, tier=chunk.tier,
            payload=self.payload(reply.chains[chunk.index], chunk.data, reply.writer,
                                 reply.refused)))

    def _summary(self, started: float, reply: _Reply, plan: ResumePlan) -> pb.ResumeSummary:
        """The summary of what was read and sent, with its metrics and request notes."""
        restore_s = time.perf_counter() - started
        if plan.window is not None and plan.window_tier is not None:
            reply.tiers.add(plan.window_tier)
        lowest = self._lowest(reply.tiers)
        self.metrics.restore_seconds.labels(lowest or "none").observe(restore_s)
        requests.record_phase("read_send", restore_s)
        requests.note(tier=lowest or "none")
        return pb.ResumeSummary(tier=lowest, restore_seconds=restore_s)

    def _backend(self, session: str, spec: LayoutSpec) -> ReplayBackend:
        """The backend that rebuilds ``spec``'s window, else ReplayUnavailable."""
        backend, why_none = self.replay()
        if backend is None:
            raise ReplayUnavailable(f"{session} needs its window rebuilt by replay, and "
                                    f"{why_none}; Restore returns its persistent part")
        if spec.replayer not in self.replayers:
            runs = ", ".join(sorted(self.replayers)) or "none"
            raise ReplayUnavailable(
                f"{session} needs its window rebuilt by replay, and nothing on this server "
                f"replays layout {spec.layout_id} (its replayer: {spec.replayer}; this "
                f"server's replayers: {runs}); Restore returns its persistent part")
        return backend

    async def _rebuilt(self, session: str, spec: LayoutSpec, rebuilding: asyncio.Future
                       ) -> ReplayResult:
        """The replay's result, counted in the metrics."""
        try:
            rebuilt = await rebuilding
        except LayoutMismatch as exc:  # the store's verified bytes: the model differs
            raise ReplayUnavailable(
                f"{session} needs its window rebuilt by replay, and the {spec.replayer} "
                f"replayer here cannot rebuild layout {spec.layout_id}: {exc}") from exc
        self.metrics.replays.inc()
        self.metrics.replayed_tokens.inc(rebuilt.replayed_tokens)
        self.metrics.replay_seconds.observe(rebuilt.seconds)
        self.metrics.replay_batch_size.observe(rebuilt.batch_size)
        requests.note(replay_tokens=rebuilt.replayed_tokens,
                      replay_ms=round(rebuilt.seconds * 1000, 3))
        return rebuilt

    def _replayable(self, spec: LayoutSpec, backend: ReplayBackend | None) -> bool:
        return backend is not None and spec.replayer in self.replayers

    async def _keep_window(self, tenant: str, session_id: str, generation: int,
                           window: Buffer, replayed_tokens: int) -> None:
        """Store a window rebuilt by a replay of ``replayed_tokens`` tokens, so the next
        Resume of this generation that asks for no more finds it held (kept here, where
        its bytes are, whichever way the reply carried them), unless a window at least as
        good is stored. The resume itself succeeded whatever happens here."""
        try:
            tier = await self.manager.store_window(tenant, session_id, generation, window,
                                                   replayed_tokens=replayed_tokens)
        except KVTierError as exc:  # spilled again or deleted meanwhile: nothing to keep
            log.info("rebuilt window of %s/%s not kept: %s", tenant, session_id, exc)
            return
        if tier is None:
            log.info("rebuilt window of %s/%s not kept here (no window tier has room, or "
                     "another node holds a better one)", tenant, session_id)

    def reply_segment(self, opts: StreamOptions, size: int
                      ) -> tuple[Lease | None, PackedWriter | None, str]:
        """The segment a reply of ``size`` bytes goes in, as ``opts`` asks (the lease
        rules of proto/kvtier.proto), its writer, and why none was leased where a bound
        refused it (the bytes then go inline): (lease, writer, refused). Give the lease
        back with ``self.leases.done`` when the reply ends."""
        if not opts.use_shared_memory or self.leases is None:
            return None, None, ""
        lease, refused = None, ""
        try:
            lease = self.leases.reply_segment(opts.peer, opts.reply_lease, size)
        except SharedMemoryExhausted as exc:  # a bound reached: the bytes go inline
            refused = str(exc)
        self.metrics.shm_segments.set(len(self.leases))
        writer = PackedWriter(lease.map, lease.lease_id) if lease is not None else None
        return lease, writer, refused

    def in_segment(self, chunks: Sequence[Buffer | None], writer: PackedWriter
                   ) -> list[pb.SharedMemoryRef]:
        """Each of ``chunks`` written into the reply segment (an empty ref for None): its
        place; counted once for the batch."""
        refs = [pb.SharedMemoryRef(lease_id=writer.lease_id, offset=writer.used, length=0)
                if data is None else writer.add(data) for data in chunks]
        self.metrics.restore_bytes.labels("shm").inc(sum(ref.length for ref in refs))
        return refs

    def payload(self, key: str, data: Buffer, writer: PackedWriter | None, refused: str = ""
                ) -> pb.Payload:
        """``data`` in the segment while it fits, else inline (``MessageTooLarge`` past the
        message limit)."""
        if writer is not None and writer.fits(len(data)):
            self.metrics.restore_bytes.labels("shm").inc(len(data))
            return pb.Payload(key=key, shm=writer.add(data))
        if len(data) > self.max_payload:
            raise MessageTooLarge(f"a {len(data)} B block exceeds the {self.max_payload} B message "
                           "limit: raise max_message_bytes or use shared memory"
                           + (f" (refused: {refused})" if refused else ""))
        self.metrics.restore_bytes.labels("grpc").inc(len(data))
        return pb.Payload(key=key, data=bytes(data))

    def _lowest(self, tiers: set[str]) -> str:
        order = [t.name for t in self.manager.tiers]
        return max(tiers, key=order.index) if tiers else ""

    async def _sections(self, spec: LayoutSpec, buffers: list[Buffer]
                        ) -> AsyncIterator[pb.LayerSection]:
        decoded = await asyncio.gather(
            *(asyncio.to_thread(decode_chunk, buf, spec) for buf in buffers))
        sums = [_checksums(chunk) for chunk in decoded]
        for index, name, layer, chunk_index in section_order(spec, len(decoded)):
            yield _section(decoded[chunk_index], sums[chunk_index], index, name, layer,
                           chunk_index)


def _settle(rebuilding: asyncio.Future) -> None:
    """A replay the call no longer waits for: cancelled, or its failure taken (the call
    has failed already)."""
    if not rebuilding.done():
        rebuilding.cancel()
    elif not rebuilding.cancelled():
        rebuilding.exception()


async def _already_read(chunks: list[RestoredChunk]) -> AsyncIterator[RestoredChunk]:
    """Chunks read ahead, yielded as ``SessionReader.chunks`` yields them."""
    for chunk in chunks:
        yield chunk


def _window_bound(spec: LayoutSpec) -> int:
    """The most bytes a rebuilt window blob of ``spec`` can take (each ephemeral stream
    alone as a chunk over the whole window bounds any grouping of them)."""
    return sum(max_encoded_bytes(spec, spec.window_tokens, True, (s.name,))
               for s in spec.ephemeral_streams)


def _checksums(chunk: DecodedChunk) -> dict[tuple[int, int, int], int]:
    """The codec's section checksums by (stream index, layer, part)."""
    rows = chunk.header.sections
    keys = zip(rows["stream"].tolist(), rows["layer"].tolist(), rows["part"].tolist(),
               strict=True)
    return dict(zip(keys, rows["checksum"].tolist(), strict=True))


def _bytes(tensor: torch.Tensor | None) -> bytes:
    if tensor is None:
        return b""
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _section(chunk: DecodedChunk, sums: dict, stream_index: int, name: str, layer: int,
             chunk_index: int) -> pb.LayerSection:
    data = chunk.streams[name]
    return pb.LayerSection(
        stream=name, layer=layer, chunk_index=chunk_index,
        codes=_bytes(data.codes[layer]),
        scales=_bytes(None if data.scales is None else data.scales[layer]),
        codes_xxh3=sums[(stream_index, layer, 0)],
        scales_xxh3=sums.get((stream_index, layer, 1), EMPTY_XXH3))
