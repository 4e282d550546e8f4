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
engine's own, else the tokens of the replay that built it); a Restore returns the stored
window as it is. A Resume whose R (at most the session's length) exceeds that replay
rebuilds the window with its R, where this server replays, and the store keeps whichever
of the two covers more, never a partial one (fewer than W tokens:
``TierManager.store_window``), so a Restore never serves a window a Resume would rebuild.

Each block comes from the highest tier holding an intact copy (verified by the manager);
no tier with an intact copy raises ``DataLoss`` before any byte of that block is sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from kvstore.format.chunk import DecodedChunk, decode_chunk, max_encoded_bytes
from kvstore.format.errors import (
    DataLoss,
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
from kvstore.session.restore import RestoredChunk
from kvstore.tiers.base import Buffer
from kvtier.shm import PackedWriter
from proto import kvtier_pb2 as pb
from services.server import requests
from services.server.metrics import ServiceMetrics
from services.server.replay_backend import ReplayBackend
from services.server.shm_leases import Lease, LeaseTable

MESSAGE_MARGIN = 4096  # room for the fields around one payload in a reply


log = logging.getLogger(__name__)

@dataclass
class StreamOptions:
    layer_by_layer: bool = False
    want_window: bool = False
    use_shared_memory: bool = False
    reply_lease: str = ""  # a shared memory lease of the caller's, offered to write into
    peer: str = ""  # the caller's connection: whose leases these are
    resume: bool = False  # rebuild a dropped window by bounded replay
    replay_tokens: int = 128
    model_fingerprint: str = ""  # the caller's model; "": not checked


class RestoreStreamer:
    def __init__(self, manager: TierManager, metrics: ServiceMetrics,
                 leases: LeaseTable | None,
                 replay: Callable[[], tuple[ReplayBackend | None, str]],
                 max_message_bytes: int, replayers: frozenset[str] = frozenset()) -> None:
        self.manager = manager
        self.replayers = replayers  # the layouts' replayers the backend runs
        self.metrics = metrics
        self.leases = leases
        self.replay = replay
        self.max_payload = max_message_bytes - MESSAGE_MARGIN

    async def stream(self, tenant: str, session_id: str, opts: StreamOptions
                     ) -> AsyncIterator[pb.RestoreReply]:
        started = time.perf_counter()
        lease, writer, refused, rebuilding = None, None, "", None
        try:
            async with self.manager.reading(tenant, session_id) as reader:
                m, spec = reader.manifest, reader.spec
                check_model(opts.model_fingerprint, m.model_fingerprint,
                            f"{tenant}/{session_id}")
                has_window = bool(spec.ephemeral_streams)
                backend, why_none = self.replay()
                # A stored window made by a shorter replay than this Resume asks for is
                # rebuilt with the larger R where this server can replay.
                rebuild = (opts.resume and m.window_key is not None
                           and m.window_coverage < min(opts.replay_tokens, m.num_tokens)
                           and self._replayable(spec, backend))
                window, window_tier = (await reader.window()
                                       if (opts.want_window or opts.resume) and not rebuild
                                       else (None, None))
                held = window is not None or (m.window_tier is not None and not opts.want_window
                                              and not opts.resume)
                replay = has_window and not held
                if replay and opts.resume:
                    self._check_replayable(f"{tenant}/{session_id}", spec, backend, why_none)
                size = sum(m.chunk_sizes) + len(m.tail) + (len(window) if window else 0)
                if replay and opts.resume:  # the rebuilt window goes in the segment too
                    size += _window_bound(spec)
                lease, writer, refused = self.reply_segment(opts, size)
                requests.note(bytes=size, generation=m.generation)
                split = [split_block_key(key) for key in m.chunk_keys]
                chains = [chain for chain, _ in split]
                restored = _explained(reader.chunks(), m.writeback_failed)
                tables = []
                if opts.layer_by_layer:  # the header carries every chunk's table
                    got = [chunk async for chunk in restored]
                    restored = _listed(got)
                    tables = [chunk_table(c.data) for c in got] + (
                        [chunk_table(m.tail)] if m.tail else [])
                yield pb.RestoreReply(header=pb.SessionHeader(
                    layout_id=m.layout_id, generation=m.generation, num_tokens=m.num_tokens,
                    token_ids=m.token_ids.tobytes(), chunk_keys=chains,
                    chunk_digests=[digest for _, digest in split],
                    tail_digest=chunk_digest(m.tail) if m.tail else b"",
                    model_fingerprint=m.model_fingerprint,
                    dedupe_domain=shared_domain(m.dedupe_scope),
                    window_available=held, replay_needed=replay,
                    window_replayed_tokens=m.window_replayed if held else 0,
                    window_tier=window_tier or (m.window_tier or "") if held else "",
                    window_digest=chunk_digest(window) if window is not None else b"",
                    chunk_tables=tables,
                    writeback_failed=m.writeback_failed,
                    reply_segment=self.leases.describe(lease) if lease is not None else None))
                chunks: list[Buffer] = []
                tiers: set[str] = set()
                keep = opts.layer_by_layer or (opts.resume and replay)
                if opts.resume and replay and not opts.layer_by_layer:
                    # Every chunk read first, so the replay (in its worker thread) runs
                    # while they are sent: the client receives during the replay.
                    got = [chunk async for chunk in restored]
                    rebuilding = asyncio.ensure_future(backend.rebuild(
                        spec, m.token_ids, [c.data for c in got], m.tail, opts.replay_tokens,
                        model_fingerprint=m.model_fingerprint))
                    restored = _listed(got)
                async for chunk in restored:
                    tiers.add(chunk.tier)
                    if keep:
                        chunks.append(chunk.data)
                    if not opts.layer_by_layer:
                        yield pb.RestoreReply(chunk=pb.RestoredChunk(
                            index=chunk.index, tier=chunk.tier,
                            payload=self.payload(chains[chunk.index], chunk.data, writer,
                                                  refused)))
                if opts.layer_by_layer:
                    buffers = chunks + ([m.tail] if m.tail else [])
                    async for section in self._sections(spec, buffers):
                        yield pb.RestoreReply(section=section)
                elif m.tail:
                    yield pb.RestoreReply(tail=self.payload("", m.tail, writer, refused))
                if window is not None:
                    yield pb.RestoreReply(window=self.payload("", window, writer, refused))
                tokens, tail = m.token_ids, m.tail
            restore_s = time.perf_counter() - started
            if window_tier:
                tiers.add(window_tier)
            lowest = self._lowest(tiers)
            self.metrics.restore_seconds.labels(lowest or "none").observe(restore_s)
            summary = pb.ResumeSummary(tier=lowest, restore_seconds=restore_s)
            requests.record_phase("read_send", restore_s)
            requests.note(tier=lowest or "none")
            if opts.resume and replay:
                try:
                    # the wait for the replay (a failed one too); it began during the send
                    # when the chunks were read first
                    with requests.phase("replay"):
                        rebuilt = await (rebuilding if rebuilding is not None else
                                         backend.rebuild(spec, tokens, chunks, tail,
                                                         opts.replay_tokens,
                                                         model_fingerprint=m.model_fingerprint))
                except LayoutMismatch as exc:  # the store's verified bytes: the model differs
                    raise ReplayUnavailable(
                        f"{tenant}/{session_id} needs its window rebuilt by replay, and the "
                        f"{spec.replayer} replayer here cannot rebuild layout "
                        f"{spec.layout_id}: {exc}") from exc
                self.metrics.replays.inc()
                self.metrics.replayed_tokens.inc(rebuilt.replayed_tokens)
                self.metrics.replay_seconds.observe(rebuilt.seconds)
                self.metrics.replay_batch_size.observe(rebuilt.batch_size)
                yield pb.RestoreReply(window=self.payload("", rebuilt.window, writer))
                await self._keep_window(tenant, session_id, m.generation, rebuilt.window,
                                        rebuilt.replayed_tokens)
                requests.note(replay_tokens=rebuilt.replayed_tokens,
                              replay_ms=round(rebuilt.seconds * 1000, 3))
                summary.replayed = True
                summary.replay_tokens = rebuilt.replayed_tokens
                summary.replay_seconds = rebuilt.seconds
                summary.window_digest = chunk_digest(rebuilt.window)
            if opts.resume:
                self.metrics.resume_seconds.labels(lowest or "none").observe(
                    time.perf_counter() - started)
            yield pb.RestoreReply(summary=summary)
        finally:
            if rebuilding is not None:  # the call may have ended before the replay did
                if not rebuilding.done():
                    rebuilding.cancel()
                elif not rebuilding.cancelled():
                    rebuilding.exception()  # a failure seen: the call has failed already
            if lease is not None:  # renewed: the client copies out, then may offer it again
                self.leases.done(lease)

    def _replayable(self, spec: LayoutSpec, backend: ReplayBackend | None) -> bool:
        return backend is not None and spec.replayer in self.replayers

    def _check_replayable(self, session: str, spec: LayoutSpec,
                          backend: ReplayBackend | None, why_none: str) -> None:
        """ReplayUnavailable unless this server can rebuild ``spec``'s window."""
        if backend is None:
            raise ReplayUnavailable(f"{session} needs its window rebuilt by replay, and "
                                    f"{why_none}; Restore returns its persistent part")
        if spec.replayer not in self.replayers:
            runs = ", ".join(sorted(self.replayers)) or "none"
            raise ReplayUnavailable(
                f"{session} needs its window rebuilt by replay, and nothing on this server "
                f"replays layout {spec.layout_id} (its replayer: {spec.replayer}; this "
                f"server's replayers: {runs}); Restore returns its persistent part")

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

    def in_segment(self, data: Buffer | None, writer: PackedWriter) -> pb.SharedMemoryRef:
        """``data`` written into the reply segment (an empty ref for None): its place."""
        if data is None:
            return pb.SharedMemoryRef(lease_id=writer.lease_id, offset=writer.used, length=0)
        self.metrics.restore_bytes.labels("shm").inc(len(data))
        return writer.add(data)

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


async def _listed(chunks: list[RestoredChunk]) -> AsyncIterator[RestoredChunk]:
    for chunk in chunks:
        yield chunk


def _window_bound(spec: LayoutSpec) -> int:
    """The most bytes a rebuilt window blob of ``spec`` can take (each ephemeral stream
    alone as a chunk over the whole window bounds any grouping of them)."""
    return sum(max_encoded_bytes(spec, spec.window_tokens, True, (s.name,))
               for s in spec.ephemeral_streams)


async def _explained(chunks: AsyncIterator[RestoredChunk], writeback_failed: bool
                     ) -> AsyncIterator[RestoredChunk]:
    """``chunks``, with a lost chunk of a session whose write-back failed said to be that:
    a memory ack that did not survive, which Stat reported."""
    try:
        async for chunk in chunks:
            yield chunk
    except DataLoss as exc:
        if not writeback_failed:
            raise
        raise DataLoss(f"{exc} (this generation was acked in memory and its write-back to "
                       "a durable tier failed)") from exc


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
