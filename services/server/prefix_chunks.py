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
header naming where (``chunk_refs``), then only the ``MissingChunk``s. Asked ``in_place``
too, the chunks read from the shared host tier (``kvstore.tiers.arena``) are not copied:
they are pinned where they lie under one read lease (``LeaseTable.pin_reads``) and the
header names their slabs; only the others go in the segment.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Iterable, Iterator

from kvstore.format.errors import (
    ChunksNotHeld,
    CodecError,
    InvalidRequest,
    MissingChunks,
    SharedMemoryExhausted,
)
from kvstore.format.keys import block_key, dedupe_scope
from kvstore.session.manager import TierManager
from kvstore.session.prefix_chunks import ChunkRead
from kvstore.tiers.arena import ArenaTier, Slot
from kvtier.shm import PackedWriter
from proto import kvtier_pb2 as pb
from services.server import chunk_requests as check
from services.server import validate
from services.server.config import ServerConfig
from services.server.layout_registry import ServerLayouts
from services.server.limits import Limits, idle_bounded
from services.server.restore_stream import RestoreStreamer, StreamOptions
from services.server.shm_leases import ReadLease
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
        # the host tier same-host clients read in place (None: it is not in shared memory)
        self.arena = next((t for t in manager.tiers if isinstance(t, ArenaTier)), None)

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

    def _pin(self, request: pb.ReadChunksRequest, chunks: list[ChunkRead], scope: str,
             peer: str) -> tuple[dict[int, Slot], ReadLease | None]:
        """Asked ``in_place`` (over shared memory, refs in the header): the chunks read
        from the shared host tier pinned in ``scope``'s slabs under one read lease, by
        position; none past a lease bound (they then go in the reply segment)."""
        leases = self.streamer.leases
        if not (request.in_place and request.use_shared_memory and request.refs_in_header
                and self.arena is not None and leases is not None):
            return {}, None
        held = [n for n, c in enumerate(chunks) if c.data is not None and c.tier == self.arena.name]
        slots = self.arena.pin_many([block_key(chunks[n].chain_key, chunks[n].digest)
                                     for n in held], scope)
        pinned = {n: slot for n, slot in zip(held, slots, strict=True) if slot is not None}
        if not pinned:
            return {}, None
        try:
            read = leases.pin_reads(peer, list(pinned.values()), self.arena.unpin)
        except SharedMemoryExhausted:
            for slot in pinned.values():
                self.arena.unpin(slot)
            return {}, None
        self.streamer.metrics.restore_bytes.labels("in_place").inc(read.size)
        return pinned, read

    def _refs_in_header(self, header: pb.ChunksHeader, chunks: list[ChunkRead],
                        pinned: dict[int, Slot], read: ReadLease | None,
                        writer: PackedWriter | None, refused: str
                        ) -> Iterator[pb.ReadChunksReply]:
        """The reply with every chunk's place in the header: the header, then the
        missing chunks (and those the segment was refused for, inline)."""
        # the segment was leased for the bytes not pinned: every chunk fits
        header.chunk_refs.extend(self._refs(chunks, pinned, writer))
        if read is not None:
            header.read_lease = read.lease_id
            header.arena_slabs.extend(self._slabs(pinned.values()))
        yield pb.ReadChunksReply(header=header)
        for n, c in enumerate(chunks):
            if c.data is None:
                yield pb.ReadChunksReply(missing=pb.MissingChunk(index=c.index,
                                                                 reason=c.missing))
            elif n not in pinned and writer is None:  # the segment was refused
                yield pb.ReadChunksReply(chunk=pb.RestoredChunk(
                    index=c.index, tier=c.tier,
                    payload=self.streamer.payload(c.chain_key, c.data, None, refused)))

    def _refs(self, chunks: list[ChunkRead], pinned: dict[int, Slot],
              writer: PackedWriter | None) -> list[pb.SharedMemoryRef]:
        """Where each chunk lies: its pinned slot, its place in the reply segment, or
        nowhere (length 0: missing, or sent inline)."""
        if writer is not None:
            refs = self.streamer.in_segment(
                [None if n in pinned else c.data for n, c in enumerate(chunks)], writer)
        else:
            refs = [pb.SharedMemoryRef() for _ in chunks]
        for n, slot in pinned.items():
            refs[n] = pb.SharedMemoryRef(lease_id=slot.slab.slab_id, offset=slot.offset,
                                         length=slot.length)
        return refs

    def _slabs(self, slots: Iterable[Slot]) -> list[pb.SharedMemoryLease]:
        assert self.streamer.leases is not None  # a read lease was made
        slabs = {slot.slab.slab_id: slot.slab for slot in slots}
        return [pb.SharedMemoryLease(lease_id=slab.slab_id, name=slab.name, size=slab.size,
                                     lease_s=self.streamer.leases.lease_s)
                for slab in slabs.values()]

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
            pinned, read = self._pin(request, chunks, dedupe_scope(s.tenant, s.domain), peer)
            opts = StreamOptions(use_shared_memory=request.use_shared_memory,
                                 reply_lease=request.reply_lease, peer=peer)
            size = sum(len(c.data) for n, c in enumerate(chunks)
                       if c.data is not None and n not in pinned)
            lease, writer, refused = self.streamer.reply_segment(opts, size)
            try:
                header = pb.ChunksHeader(
                    chunk_keys=[c.chain_key for c in chunks],
                    chunk_digests=[c.digest for c in chunks],
                    reply_segment=(self.streamer.leases.describe(lease)
                                   if lease is not None and self.streamer.leases is not None
                                   else None))
                if request.refs_in_header and (writer is not None or pinned):
                    for reply in self._refs_in_header(header, chunks, pinned, read, writer,
                                                      refused):
                        yield reply
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
            except BaseException:
                if read is not None and self.streamer.leases is not None:  # never answered:
                    self.streamer.leases.release(peer, [read.lease_id])  # nothing reads it
                raise
            finally:
                if lease is not None and self.streamer.leases is not None:  # renewed: the
                    self.streamer.leases.done(lease)  # client copies out, then may offer it
