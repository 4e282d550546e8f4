"""Where chunk identity and model identity cross other features, over a real server: no
cache of the client's (a lookup, an earlier spill) stands in for the digest of the bytes
spilled now; the server honours a chunk named by key only with the digest it holds; and
the model fingerprint travels with every session, is returned by Restore, Resume and
Stat, and is enforced on restore, resume and replay (``ModelMismatch``)."""

from __future__ import annotations

import grpc
import pytest

from kvstore.errors import MissingChunks, ModelMismatch, PreconditionFailed
from kvstore.keys import dedupe_scope
from kvtier import AsyncClient, Client
from kvtier.codec import as_tokens, encode_session
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from tests.service_support import (
    LAYOUT,
    assert_streams_equal,
    raw_spill_header,
    running_server,
    streams_for,
    tokens_for,
)

N = 2 * LAYOUT.chunk_tokens + 40  # two chunks and a tail
TOKENS = as_tokens(tokens_for(N))
A = streams_for(LAYOUT, N, seed=21)
B = streams_for(LAYOUT, N, seed=22)  # other tensors under the same tokens


def _encoded(streams) -> list[bytes]:
    enc = encode_session(LAYOUT, TOKENS, streams, scope=dedupe_scope("acme"))
    return [enc.chunks[i] for i in range(len(enc.keys))], enc.tail


@pytest.mark.parametrize("given", ["streams", "chunks"])
async def test_a_lookup_never_names_other_bytes_for_a_later_spill(tmp_path, given):
    async def spill(kv, session, streams):
        if given == "streams":
            return await kv.spill("acme", session, LAYOUT.name, TOKENS, streams, generation=1)
        chunks, tail = _encoded(streams)
        return await kv.spill("acme", session, LAYOUT.name, TOKENS, chunks=chunks, tail=tail,
                              generation=1)

    async with running_server(tmp_path) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await spill(kv, "a", A)
        assert await kv.lookup("acme", LAYOUT.name, TOKENS) == 2 * LAYOUT.chunk_tokens
        b = await spill(kv, "b", B)
        assert (b.chunks_sent, b.chunks_written, b.chunks_deduped) == (2, 2, 0)
        assert_streams_equal((await kv.restore("acme", "b")).persistent, B)
        assert_streams_equal((await kv.restore("acme", "a")).persistent, A)
        # The very bytes again: the lookup still saves sending them.
        again = await spill(kv, "a2", A)
        assert (again.chunks_sent, again.chunks_deduped) == (0, 2)
        assert_streams_equal((await kv.restore("acme", "a2")).persistent, A)


async def test_a_second_spill_of_a_session_with_other_tensors_sends_them(tmp_path):
    async with running_server(tmp_path) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await kv.spill("acme", "s", LAYOUT.name, TOKENS, A, generation=1)
        second = await kv.spill("acme", "s", LAYOUT.name, TOKENS, B, generation=2)
        assert second.chunks_sent == 2
        assert_streams_equal((await kv.restore("acme", "s")).persistent, B)
        third = await kv.spill("acme", "s", LAYOUT.name, TOKENS, B, generation=3)
        assert third.chunks_sent == 0  # unchanged bytes go by key and digest
        assert_streams_equal((await kv.restore("acme", "s")).persistent, B)


def test_the_blocking_client_after_a_lookup_spills_its_own_bytes(tmp_path):
    import asyncio

    async def main():
        async with running_server(tmp_path) as (_, target):
            await asyncio.to_thread(blocking, target)

    def blocking(target):
        with Client(target, shared_memory=False) as kv:
            kv.spill("acme", "a", LAYOUT.name, TOKENS, A, generation=1)
            kv.lookup("acme", LAYOUT.name, TOKENS)
            kv.spill("acme", "b", LAYOUT.name, TOKENS, B, generation=1)
            assert_streams_equal(kv.restore("acme", "b").persistent, B)

    asyncio.run(main())


async def test_the_server_honours_a_chunk_named_by_key_only_with_the_held_digest(tmp_path):
    """A raw client naming the chunks another session holds, under the digest of its own
    other bytes, without sending them: MissingChunks, and nothing of it stored."""
    ref = pb.SessionRef(tenant="acme", session_id="b")
    a = encode_session(LAYOUT, TOKENS, A, scope=dedupe_scope("acme"))
    b = encode_session(LAYOUT, TOKENS, B, scope=dedupe_scope("acme"))
    assert a.keys == b.keys and a.digests != b.digests

    def messages(header, chunks=(), tail=b""):
        yield pb.SpillRequest(header=header)
        for key, data in chunks:
            yield pb.SpillRequest(chunk=pb.Payload(key=key, data=data))
        if tail:
            yield pb.SpillRequest(tail=pb.Payload(data=tail))

    async with running_server(tmp_path) as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        await stub.Spill(messages(raw_spill_header(pb.SessionRef(tenant="acme", session_id="a"),
                                                   TOKENS, a),
                                  zip(a.keys, a.chunks.values(), strict=True), a.tail))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Spill(messages(raw_spill_header(ref, TOKENS, b), (), b.tail))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(info.value.trailing_metadata())["kvtier-error"] == MissingChunks.__name__
        assert (await stub.Stat(pb.StatRequest())).sessions == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Stat(pb.StatRequest(session=ref))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # Its own bytes go in, and come back; the first session's are untouched.
        await stub.Spill(messages(raw_spill_header(ref, TOKENS, b),
                                  zip(b.keys, b.chunks.values(), strict=True), b.tail))
        got = (await server.manager.get_manifest("acme", "b")).chunk_keys
        assert got != (await server.manager.get_manifest("acme", "a")).chunk_keys
