"""Independent chunks over a real server (proto "Independent chunks"): many unrelated
chunks, each keyed alone as the first chunk of its own tokens, written, read and looked up
in one call each, with every guarantee of a one-chunk call kept per chunk."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore.format.checks import chunk_bytes_max
from kvstore.format.errors import InvalidRequest
from kvstore.format.keys import (
    MAX_INDEPENDENT_LOOKUP,
    block_key,
    chain_keys,
    chunk_digest,
    dedupe_scope,
    independent_keys,
)
from kvstore.format.layout import LayoutSpec, Stream
from kvtier import AsyncClient, Client, shm
from kvtier import codec as cc
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from tests.support.service import (
    LAYOUT,
    running_server,
    streams_for,
    threaded_server,
    tokens_for,
)

C = LAYOUT.chunk_tokens


def pages(count: int, seed: int = 0) -> tuple[np.ndarray, list[bytes]]:
    """(every page's tokens end to end, each page's chunk: chunk 0 of its own tokens)."""
    tokens = [cc.as_tokens(tokens_for(C, seed=seed * 1000 + i)) for i in range(count)]
    chunks = [cc.encode_chunks(LAYOUT, t, streams_for(LAYOUT, C, seed=seed * 1000 + i))[0]
              for i, t in enumerate(tokens)]
    return np.concatenate(tokens), chunks


def one_chunk_key(tokens: np.ndarray, tenant: str = "acme") -> str:
    return chain_keys(LAYOUT.layout_id, tokens, C, scope=dedupe_scope(tenant))[0]


async def test_pages_in_one_call_each_are_the_one_chunk_calls_chunks(tmp_path):
    tokens, chunks = pages(5)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        held = [0, 2, 3]
        written = await kv.write_independent_chunks(
            "acme", LAYOUT.name, np.concatenate([tokens[i * C:(i + 1) * C] for i in held]),
            [chunks[i] for i in held])
        assert (written.chunks_written, written.chunks_deduped) == (3, 0)
        assert written.chunk_keys == [one_chunk_key(tokens[i * C:(i + 1) * C]) for i in held]
        got = await kv.read_independent_chunks("acme", LAYOUT.name, tokens)
        assert got.missing == {1: "not_held", 4: "not_held"}
        assert {i: bytes(d) for i, d in got.chunks.items()} == {i: chunks[i] for i in held}
        assert got.keys == independent_keys(LAYOUT.layout_id, tokens, C,
                                            scope=dedupe_scope("acme"))
        assert await kv.lookup_independent_chunks("acme", LAYOUT.name, tokens) == \
            [True, False, True, True, False]
        # each is the very chunk a one-chunk call of its tokens reads, and dedupes with it
        alone = await kv.read_chunks("acme", LAYOUT.name, tokens[2 * C:3 * C])
        assert bytes(alone.chunks[0]) == chunks[2]
        await kv.write_chunks("acme", LAYOUT.name, tokens[C:2 * C], chunks[1:2])
        again = await kv.write_independent_chunks("acme", LAYOUT.name, tokens, chunks)
        assert (again.chunks_written, again.chunks_deduped) == (1, 4)
        assert await kv.lookup_independent_chunks("acme", LAYOUT.name, tokens) == [True] * 5
        # chained, the same tokens are another sequence: only its first chunk is a page's
        chained = await kv.read_chunks("acme", LAYOUT.name, tokens)
        assert sorted(chained.chunks) == [0] and len(chained.missing) == 4
        skipped = await kv.write_independent_chunks("acme", LAYOUT.name, tokens, chunks,
                                                    skip_held=True)
        assert (skipped.chunks_written, skipped.chunks_deduped) == (0, 5)


async def test_a_corrupt_or_lost_page_is_a_miss_of_that_page_alone(tmp_path):
    tokens, chunks = pages(4, seed=1)
    async with running_server(tmp_path, host_bytes=1024, object_bytes=0) as (server, target), \
            AsyncClient(target) as kv:
        await kv.write_independent_chunks("acme", LAYOUT.name, tokens, chunks, ack="durable")
        hits = 0
        for segment in (tmp_path / "disk" / "segments").iterdir():
            raw = bytearray(segment.read_bytes())
            at = raw.find(chunks[1])
            if at >= 0:
                raw[at + len(chunks[1]) - 5] ^= 0xFF
                segment.write_bytes(bytes(raw))
                hits += 1
        assert hits == 1
        lost = block_key(one_chunk_key(tokens[2 * C:3 * C]), chunk_digest(chunks[2]))
        await server.manager.tiers[1].delete(lost)  # behind the store's back
        got = await kv.read_independent_chunks("acme", LAYOUT.name, tokens)
        assert got.missing == {1: "corrupt", 2: "not_held"}
        assert {i: bytes(d) for i, d in got.chunks.items()} == {0: chunks[0], 3: chunks[3]}


async def test_another_domains_pages_are_misses(tmp_path):
    tokens, chunks = pages(3, seed=2)
    shared = {"dedupe_domains": {"public": ("acme",)}}
    async with running_server(tmp_path, **shared) as (_, target), AsyncClient(target) as kv:
        await kv.write_independent_chunks("acme", LAYOUT.name, tokens, chunks)
        theirs = await kv.read_independent_chunks("other", LAYOUT.name, tokens)
        assert not theirs.chunks and len(theirs.missing) == 3
        assert await kv.lookup_independent_chunks("other", LAYOUT.name, tokens) == [False] * 3
        public = await kv.read_independent_chunks("acme", LAYOUT.name, tokens,
                                                  dedupe_domain="public")
        assert len(public.missing) == 3
        other_model = await kv.read_independent_chunks("acme", LAYOUT.name, tokens,
                                                       model_fingerprint="other@1")
        assert len(other_model.missing) == 3


async def test_hostile_requests_are_refused_before_reading(tmp_path):
    tokens, chunks = pages(3, seed=3)
    bound = 2 * chunk_bytes_max(LAYOUT, C) + 100  # two of the layout's largest chunks
    async with running_server(tmp_path, max_spill_bytes=bound) as (_, target), \
            AsyncClient(target) as kv, grpc.aio.insecure_channel(target) as channel:
        await kv.write_independent_chunks("acme", LAYOUT.name, tokens[:2 * C], chunks[:2])
        with pytest.raises(InvalidRequest, match="max_spill_bytes"):  # 3 chunks: too many
            await kv.read_independent_chunks("acme", LAYOUT.name, tokens)
        tiny = LayoutSpec("one-token-pages", (Stream("page", (8,), bits=16, format="fp16"),),
                          chunk_tokens=1, vocab_size=1 << 16)
        await kv.register_layout(tiny)
        many = np.zeros(MAX_INDEPENDENT_LOOKUP + 1, np.uint32)  # a small message
        with pytest.raises(InvalidRequest, match="at most"):
            await kv.lookup_independent_chunks("acme", tiny, many)
        assert await kv.lookup_independent_chunks("acme", tiny, many[1:]) == \
            [False] * MAX_INDEPENDENT_LOOKUP
        stub = pb_grpc.KVTierStub(channel)
        # a page encoded at its chained position (start token C) is not chunk 0 of its own
        chained = cc.encode_chunks(LAYOUT, tokens[:2 * C], streams_for(LAYOUT, 2 * C))[1]
        header = pb.WriteChunksHeader(tenant="acme", layout_id=LAYOUT.name,
                                      token_ids=tokens[:2 * C].tobytes(),
                                      chunk_digests=[chunk_digest(chunks[0]),
                                                     chunk_digest(chained)],
                                      independent_chunks=True)
        keys = independent_keys(LAYOUT.layout_id, tokens[:2 * C], C, scope=dedupe_scope("acme"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.WriteChunks(_messages(
                pb.WriteChunksRequest(header=header),
                pb.WriteChunksRequest(chunk=pb.Payload(key=keys[1], data=chained))))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "each starts at token 0" in refused.value.details()
        # a chained key is not an independent chunk's
        header.chunk_digests[:] = [chunk_digest(c) for c in chunks[:2]]
        chained_key = chain_keys(LAYOUT.layout_id, tokens[:2 * C], C,
                                 scope=dedupe_scope("acme"))[1]
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await stub.WriteChunks(_messages(
                pb.WriteChunksRequest(header=header),
                pb.WriteChunksRequest(chunk=pb.Payload(key=chained_key, data=chunks[1]))))
        assert "not the chain key" in wrong.value.details()
        # one page twice in a call: refused before a byte of it is stored
        with pytest.raises(InvalidRequest, match="same tokens"):
            await kv.write_independent_chunks("acme", LAYOUT.name,
                                              np.concatenate([tokens[:C], tokens[:C]]),
                                              [chunks[0], chunks[0]])


async def _messages(*messages):
    for message in messages:
        yield message


@pytest.mark.skipif(not shm.available(), reason="no /dev/shm")
async def test_pages_over_shared_memory_both_ways(tmp_path):
    tokens, chunks = pages(4, seed=4)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        metrics = server.servicer.metrics
        sent = metrics.spill_bytes.labels("shm")._value.get()
        read = metrics.restore_bytes.labels("shm")._value.get()
        await kv.write_independent_chunks("acme", LAYOUT.name, tokens[:3 * C], chunks[:3])
        assert metrics.spill_bytes.labels("shm")._value.get() - sent == sum(map(len,
                                                                              chunks[:3]))
        with await kv.read_independent_chunks("acme", LAYOUT.name, tokens,
                                              in_place=True) as got:
            assert got.missing == {3: "not_held"}
            assert [bytes(got.chunks[i]) for i in range(3)] == chunks[:3]
        # held by the host tier: named where they lie, none copied into a reply segment
        assert metrics.restore_bytes.labels("shm")._value.get() == read
        assert metrics.restore_bytes.labels("in_place")._value.get() == sum(map(len,
                                                                              chunks[:3]))


def test_the_blocking_client_has_the_same_calls(tmp_path):
    tokens, chunks = pages(3, seed=5)
    with threaded_server(tmp_path) as live, Client(live.target) as kv:
        written = kv.write_independent_chunks("acme", LAYOUT.name, tokens[C:], chunks[1:],
                                              ack="durable")
        assert (written.chunks_written, written.durable) == (2, True)
        assert kv.lookup_independent_chunks("acme", LAYOUT.name, tokens) == [False, True, True]
        got = kv.read_independent_chunks("acme", LAYOUT.name, tokens, check_digests=False)
        assert got.missing == {0: "not_held"}
        assert [bytes(got.chunks[i]) for i in (1, 2)] == chunks[1:]
