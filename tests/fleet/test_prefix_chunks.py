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
