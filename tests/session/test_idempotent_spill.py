"""Idempotent spills: a Spill repeated at the stored generation with
identical content gets the first reply again, through the client's UNAVAILABLE retry
too; other content at that generation is FAILED_PRECONDITION (GenerationConflict)."""

from __future__ import annotations

import grpc
import pytest

from kvstore.format.errors import GenerationConflict, StaleGeneration
from kvstore.format.keys import chunk_digest, dedupe_scope
from kvtier import AsyncClient
from kvtier.codec import as_tokens, encode_session, encode_window
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from tests.support.service import (
    LAYOUT,
    raw_spill_header,
    running_server,
    streams_for,
    tokens_for,
    window_for,
)

N = 2 * LAYOUT.chunk_tokens + 40
REF = pb.SessionRef(tenant="acme", session_id="s1")


def _messages(header, enc, window: bytes | None = None):
    yield pb.SpillRequest(header=header)
    for i, data in sorted(enc.chunks.items()):
        yield pb.SpillRequest(chunk=pb.Payload(key=enc.keys[i], data=data))
    yield pb.SpillRequest(tail=pb.Payload(data=enc.tail))
    if window is not None:
        yield pb.SpillRequest(window=pb.Payload(data=window))


class LoseFirstSpillReply(grpc.aio.StreamUnaryClientInterceptor):
    """Lets the first Spill reach the server and commit, then reports UNAVAILABLE, as a
    connection dropped after the server answered would."""

    def __init__(self) -> None:
        self.lost = 0

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        call = await continuation(details, request_iterator)
        if self.lost or not details.method.endswith(b"/Spill"):
            return call
        await call  # committed on the server
        self.lost += 1
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(), details="the reply was lost")


async def test_an_identical_spill_at_the_stored_generation_gets_the_original_reply(tmp_path):
    tokens = as_tokens(tokens_for(N))
    enc = encode_session(LAYOUT, tokens, streams_for(LAYOUT, N), scope=dedupe_scope("acme"))
    window = encode_window(LAYOUT, tokens, window_for(LAYOUT, N))
    header = raw_spill_header(REF, tokens, enc, window_digest=chunk_digest(window))
    async with running_server(tmp_path) as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        first = await stub.Spill(_messages(header, enc, window))
        assert first.chunks_written == 2 and first.chunks_deduped == 0 and first.window_kept
        before = await server.manager.get_manifest("acme", "s1")
        again = await stub.Spill(_messages(header, enc, window))
        # Not "2 deduped": the first spill's reply, and nothing was stored again.
        assert again == first
        after = await server.manager.get_manifest("acme", "s1")
        assert after.updated_at == before.updated_at and after.chunk_keys == before.chunk_keys


async def test_other_content_at_the_stored_generation_is_failed_precondition(tmp_path):
    tokens = as_tokens(tokens_for(N))
    enc = encode_session(LAYOUT, tokens, streams_for(LAYOUT, N), scope=dedupe_scope("acme"))
    other = encode_session(LAYOUT, tokens, streams_for(LAYOUT, N, seed=1),
                           scope=dedupe_scope("acme"))
    longer = as_tokens(tokens_for(N + 1))
    async with running_server(tmp_path) as (server, target), \
            grpc.aio.insecure_channel(target) as channel, \
            AsyncClient(target, shared_memory=False) as kv:
        stub = pb_grpc.KVTierStub(channel)
        await stub.Spill(_messages(raw_spill_header(REF, tokens, enc), enc))
        stored = await server.manager.get_manifest("acme", "s1")
        changes = {
            "chunk bytes": _messages(raw_spill_header(REF, tokens, other), other),
            "ack": _messages(raw_spill_header(REF, tokens, enc, ack=pb.ACK_DURABLE), enc),
        }
        for name, messages in changes.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Spill(messages)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
            assert "already stored with other content" in info.value.details(), name
        with pytest.raises(GenerationConflict, match="other content"):
            await kv.spill("acme", "s1", LAYOUT.name, longer, streams_for(LAYOUT, N + 1),
                           generation=1)
        with pytest.raises(StaleGeneration, match="not newer"):
            await kv.spill("acme", "s1", LAYOUT.name, tokens, streams_for(LAYOUT, N),
                           generation=0)
        assert (await server.manager.get_manifest("acme", "s1")).chunk_keys == stored.chunk_keys


async def test_the_clients_retry_after_a_lost_reply_gets_the_first_attempts_reply(tmp_path):
    tokens = as_tokens(tokens_for(N))
    persistent = streams_for(LAYOUT, N)
    lose = LoseFirstSpillReply()
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        node = kv._router.nodes[0]  # the client's calls go through the lossy channel
        await node.channel.close()
        node.channel = grpc.aio.insecure_channel(target, interceptors=[lose])
        node.stub = pb_grpc.KVTierStub(node.channel)
        result = await kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, generation=1)
        assert lose.lost == 1  # the first attempt landed and its reply was dropped
        # The retry was answered as the first attempt was: written, not deduped.
        assert result.generation == 1 and result.chunks_written == 2
        assert result.chunks_deduped == 0
        receipt = (await server.manager.get_manifest("acme", "s1")).receipt
        assert receipt.chunks_written == 2 and result.bytes_received == receipt.bytes_received
        assert (await kv.restore("acme", "s1")).generation == 1


async def test_a_retry_after_a_restart_states_the_window_and_tier_it_finds(tmp_path):
    tokens = as_tokens(tokens_for(N))
    enc = encode_session(LAYOUT, tokens, streams_for(LAYOUT, N), scope=dedupe_scope("acme"))
    window = encode_window(LAYOUT, tokens, window_for(LAYOUT, N))
    header = raw_spill_header(REF, tokens, enc, window_digest=chunk_digest(window),
                              ack=pb.ACK_DURABLE)
    async with running_server(tmp_path) as (_, target), \
            grpc.aio.insecure_channel(target) as channel:
        first = await pb_grpc.KVTierStub(channel).Spill(_messages(header, enc, window))
    assert first.window_kept and first.durable
    # a restart keeps no window (host RAM): the retry must not say one is held
    async with running_server(tmp_path) as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        again = await pb_grpc.KVTierStub(channel).Spill(_messages(header, enc, window))
        stored = await server.manager.get_manifest("acme", "s1")
        assert stored.window_key is None
        assert not again.window_kept
        assert first.tier == "host" and again.tier == "disk"  # memory does not survive
        assert (again.chunks_written, again.chunks_deduped, again.bytes_received,
                again.durable) == (first.chunks_written, first.chunks_deduped,
                                   first.bytes_received, first.durable)
