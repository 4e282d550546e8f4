"""The WriteChunks and ReadChunks calls (proto "Prefix chunks"): requests checked
(``services.server.chunk_requests``), served by ``TierManager.write_chunks`` /
``read_chunks`` (``kvstore.session.prefix_chunks``), replies built here.

WriteChunks is bounded as a Spill is: a stream slot, the idle bound, its payload bytes
by ``max_spill_bytes`` and held as in-flight bytes of the tenant until it ends.
ReadChunks holds a stream slot; its reply is one ``ChunksHeader`` (after every chunk was
read, so its digests are those of the bytes that follow), then a ``RestoredChunk`` or
``MissingChunk`` per chunk in index order, the bytes inline or in the caller's shared
memory under the Restore rules (``RestoreStreamer.reply_segment``). Asked for
``refs_in_header``, a reply in shared memory is every chunk written into the segment, the
header naming where (``chunk_refs``), then only the ``MissingChunk``s.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable

from kvstore.format.errors import ChunksNotHeld, CodecError, InvalidRequest, MissingChunks
from kvstore.session.manager import TierManager
from proto import kvtier_pb2 as pb
from services.server import chunk_requests as check
from services.server import validate
from services.server.config import ServerConfig
from services.server.layout_registry import ServerLayouts
from services.server.limits import Limits, idle_bounded
from services.server.restore_stream import RestoreStreamer, StreamOptions
from services.serving import auth

TOKEN_BYTES_ON_LOOP = 256 << 10  # token ids hashed on the event loop at most (under 1 ms)

# (payload, peer, bytes left to the call) -> the payload's bytes (inline or shared memory)
PayloadBytes = Callable[[pb.Payload, str, int], bytes]


class PrefixChunkCalls:
    def __init__(self, manager: TierManager, config: ServerConfig, limits: Limits,
                 layouts: ServerLayouts, streamer: RestoreStreamer,
                 payload_bytes: PayloadBytes, max_tokens: int) -> None:
        self.manager = manager
        self.config = config
        self.limits = limits
        self.layouts = layouts
        self.streamer = streamer
        self.payload_bytes = payload_bytes
        self.max_tokens = max_tokens

    async def write(self, messages: AsyncIterator[pb.WriteChunksRequest], peer: str
                    ) -> pb.WriteChunksReply:
        with self.limits.stream(peer, "WriteChunks"), self.limits.in_flight() as flight:
            incoming: check.IncomingChunks | None = None
            budget = self.config.max_spill_bytes
            async for message in idle_bounded(messages, self.limits.idle_s, "WriteChunks"):
                kind = validate.stream_item(message, incoming is not None)
                if kind == "header":
                    header = message.header
                    tenant = check.tenant_of(header, "header.")
                    auth.check_tenant(tenant)  # before anything of it is hashed or held
                    flight.reserve(tenant, message.ByteSize())
                    await self.layouts.resolve(header.layout_id)  # another node's
                    checked = functools.partial(
                        check.write_header, header, self.config.default_ack,
                        self.max_tokens, self.config.dedupe_domains)
                    # every chain key is hashed: a long sequence is checked off the loop
                    incoming = (await asyncio.to_thread(checked)
                                if len(header.token_ids) > TOKEN_BYTES_ON_LOOP else checked())
                    continue
                assert incoming is not None  # the header came first (stream_item)
                payload = message.chunk
                if payload.WhichOneof("body") == "shm" and \
                        payload.shm.length > incoming.payload_limit:
                    raise InvalidRequest(f"a chunk payload is {payload.shm.length} B of shared "
                                         "memory; the layout encodes a chunk in at most "
                                         f"{incoming.payload_limit} B")
                data = self.payload_bytes(payload, peer, budget - incoming.bytes_received)
                flight.reserve(incoming.scope.tenant, len(data))
                incoming.add_chunk(payload.key, data)
            request = validate.stream_ended(incoming, "WriteChunks").finish()
            try:
                written = await self.manager.write_chunks(request)
            except ChunksNotHeld as exc:
                raise MissingChunks(str(exc)) from exc
            except CodecError as exc:
                raise InvalidRequest(f"written bytes do not verify: {exc}") from exc
        return pb.WriteChunksReply(chunks_written=written.written,
                                   chunks_deduped=written.deduped, tier=written.tier,
                                   durable=written.durable, chunk_keys=written.chain_keys)

    async def read(self, request: pb.ReadChunksRequest, peer: str
                   ) -> AsyncIterator[pb.ReadChunksReply]:
        with self.limits.stream(peer, "ReadChunks"):
            auth.check_tenant(check.tenant_of(request))
            await self.layouts.resolve(request.layout_id)  # another node's
            asked = check.read_request(request, self.max_tokens, self.config.dedupe_domains,
                                       self.config.max_spill_bytes)
            s = asked.scope
            chunks = await self.manager.read_chunks(
                s.tenant, s.spec.layout_id, s.tokens, first_chunk=asked.first,
                count=asked.count, digests=asked.digests, model_fingerprint=s.fingerprint,
                dedupe_domain=s.domain, independent=s.independent)
            opts = StreamOptions(use_shared_memory=request.use_shared_memory,
                                 reply_lease=request.reply_lease, peer=peer)
            size = sum(len(c.data) for c in chunks if c.data is not None)
            lease, writer, refused = self.streamer.reply_segment(opts, size)
            try:
                header = pb.ChunksHeader(
                    chunk_keys=[c.chain_key for c in chunks],
                    chunk_digests=[c.digest for c in chunks],
                    reply_segment=(self.streamer.leases.describe(lease)
                                   if lease is not None and self.streamer.leases is not None
                                   else None))
                if request.refs_in_header and writer is not None:
                    # the segment was leased for these bytes: every chunk fits
                    header.chunk_refs.extend(self.streamer.in_segment(
                        [c.data for c in chunks], writer))
                    yield pb.ReadChunksReply(header=header)
                    for c in chunks:
                        if c.data is None:
                            yield pb.ReadChunksReply(missing=pb.MissingChunk(
                                index=c.index, reason=c.missing))
                    return
                yield pb.ReadChunksReply(header=header)
                for c in chunks:
                    if c.data is None:
                        yield pb.ReadChunksReply(missing=pb.MissingChunk(index=c.index,
                                                                         reason=c.missing))
                        continue
                    yield pb.ReadChunksReply(chunk=pb.RestoredChunk(
                        index=c.index, tier=c.tier,
                        payload=self.streamer.payload(c.chain_key, c.data, writer, refused)))
            finally:
                if lease is not None and self.streamer.leases is not None:  # renewed: the
                    self.streamer.leases.done(lease)  # client copies out, then may offer it
