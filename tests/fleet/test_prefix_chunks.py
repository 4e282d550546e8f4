"""Prefix chunks of no session across a fleet (metadata = "shared"): chunks one node wrote
(WriteChunks) are read by position on another through Redis (a real three-master
Redis Cluster) or, Redis flushed, the bucket (moto's S3 server); never another tenant's."""

from __future__ import annotations

from kvstore.format.keys import split_block_key
from kvstore.session.prefix_chunks import ChunkWrite
from tests.support import hot_tier
from tests.support.hot_tier import nodes
from tests.support.manager import TINY, make_session, random_tokens

C = TINY.chunk_tokens
node_config = hot_tier.node_config  # the fixture: three nodes' configs


async def test_chunks_written_on_a_are_read_on_b(node_config, redis_cluster,
                                                 redis_cluster_process):
    async with nodes(node_config, redis_cluster) as (a, b, c):
        tokens = random_tokens(4 * C, 1)
        session = make_session(tokens, seed=1, tenant="acme")
        keys = [key for key, _ in session["chunks"]]
        chunks = [data for _, data in session["chunks"]]
        written = await a.write_chunks(ChunkWrite(
            tenant="acme", layout_id=TINY.layout_id, token_ids=tokens, first_chunk=0,
            digests=[split_block_key(key)[1] for key in keys], chunks=dict(enumerate(chunks)),
            ack="durable"))
        assert written.written == 4
        got = await b.read_chunks("acme", TINY.layout_id, tokens, first_chunk=1, count=3)
        assert [bytes(r.data) for r in got] == chunks[1:]
        assert {r.tier for r in got} == {"redis"}
        # another tenant's identical tokens chain elsewhere: nothing
        theirs = await c.read_chunks("beta", TINY.layout_id, tokens, first_chunk=0, count=4)
        assert {r.missing for r in theirs} == {"not_held"}
        redis_cluster_process.flushall()  # the shared cache lost: the bucket answers
        got = await c.read_chunks("acme", TINY.layout_id, tokens, first_chunk=0, count=4)
        assert [bytes(r.data) for r in got] == chunks
        assert {r.tier for r in got} == {"object"}


async def test_independent_chunks_written_on_a_are_found_and_read_on_b(
        node_config, redis_cluster, redis_cluster_process):
    """Pages (each chunk 0 of its own tokens) written on one node: another node's Lookup
    of independent chunks learns them from Redis, then, Redis flushed, from the bucket;
    a page never written stays a miss among them."""
    async with nodes(node_config, redis_cluster) as (a, b, c):
        pages = [random_tokens(C, 10 + i) for i in range(4)]
        sessions = [make_session(t, seed=10 + i, tenant="acme") for i, t in enumerate(pages)]
        chunks = [s["chunks"][0][1] for s in sessions]
        held = [0, 1, 3]
        written = await a.write_chunks(ChunkWrite(
            tenant="acme", layout_id=TINY.layout_id,
            token_ids=[t for i in held for t in pages[i]], first_chunk=0,
            digests=[split_block_key(sessions[i]["chunks"][0][0])[1] for i in held],
            chunks={n: chunks[i] for n, i in enumerate(held)}, ack="durable",
            independent=True))
        assert written.written == 3
        every = [t for page in pages for t in page]
        found = await b.lookup_fleet("acme", TINY.layout_id, every, independent=True)
        assert [chunk.index for chunk in found.chunks] == held
        got = await b.read_chunks("acme", TINY.layout_id, every, first_chunk=0, count=4,
                                  independent=True)
        assert [r.missing for r in got] == ["", "", "not_held", ""]
        assert [bytes(got[i].data) for i in held] == [chunks[i] for i in held]
        redis_cluster_process.flushall()  # the shared cache lost: the bucket answers
        found = await c.lookup_fleet("acme", TINY.layout_id, every, independent=True)
        assert [chunk.index for chunk in found.chunks] == held
        theirs = await c.lookup_fleet("beta", TINY.layout_id, every, independent=True)
        assert not theirs.chunks
