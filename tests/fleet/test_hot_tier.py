"""The fleet's shared hot tier (docs/fleet.md, "What lives where"): with metadata =
"shared", Redis (here a real three-master Redis Cluster) holds every spill's chunks
beside the bucket (moto's S3 server), so another node resumes from Redis, not S3; a
read that had to go to the bucket leaves a copy in Redis for the next node; a spill may
name by key alone chunks another node wrote; Redis down costs nothing durable (a master
down: fleet/test_servers.py). Real servers' stores (``open_manager``), as fleet/test_fleet.py,
and real servers over gRPC for what Stat reports."""

from __future__ import annotations

import dataclasses

import pytest
from redis.cluster import RedisCluster

from kvstore.format.errors import ChunksNotHeld
from kvtier import AsyncClient
from services.server.config import ServerConfig
from tests.support import hot_tier
from tests.support.fleet import fleet_servers
from tests.support.hot_tier import PREFIX, assert_same, nodes
from tests.support.manager import TINY, make_session, random_tokens

node_config = hot_tier.node_config  # the fixture: three nodes' configs


def in_redis(url: str, keys) -> list[bool]:
    with RedisCluster.from_url(url.replace("redis+cluster://", "redis://")) as client:
        return [bool(client.exists(PREFIX + key)) for key in keys]


async def test_a_durable_spill_writes_through_to_redis_and_another_node_resumes_from_it(
        node_config, redis_cluster):
    async with nodes(node_config, redis_cluster, "ab") as (a, b):
        session = make_session(random_tokens(70, 1), seed=1, tenant="acme")
        keys = [key for key, _ in session["chunks"]]
        assert in_redis(redis_cluster, keys) == [False] * len(keys)
        await a.spill("acme", "s1", generation=1, ack="durable", **session)
        assert in_redis(redis_cluster, keys) == [True] * len(keys)  # and in the bucket:
        assert all(set(a.where(key)) >= {"host", "redis", "object"} for key in keys)

        got = await b.restore("acme", "s1")  # b never saw these chunks
        assert_same(got, session)
        assert got.chunk_tiers == ["redis"] * len(keys)
        assert b.counters.hits["redis"] == len(keys) and not b.counters.hits["object"]

        # a memory ack too (its write-back goes to the bucket only)
        memory = make_session(random_tokens(70, 9), seed=9, tenant="acme")
        await a.spill("acme", "s2", generation=1, ack="memory", **memory)
        assert all(in_redis(redis_cluster, [key for key, _ in memory["chunks"]]))


async def test_host_eviction_does_not_demote_into_redis_what_it_holds(
        node_config, redis_cluster):
    sessions = [make_session(random_tokens(70, i), seed=i, tenant="acme") for i in range(4)]
    size = sum(len(d) for _, d in sessions[0]["chunks"]) + len(sessions[0]["window"])
    async with nodes(node_config, redis_cluster, "a", host_bytes=2 * size) as (a,):
        for i, session in enumerate(sessions):
            await a.spill("acme", f"s{i}", generation=1, ack="durable", **session)
        written = sum(len(d) for s in sessions for _, d in s["chunks"])
        assert a.counters.evictions["host"] > 0  # the host tier holds two sessions
        assert a.counters.bytes_written["redis"] == written  # each chunk once, at its spill
        assert not a.counters.demotions["redis"]
        for i, session in enumerate(sessions):
            assert_same(await a.restore("acme", f"s{i}"), session)


async def test_a_read_from_the_bucket_leaves_a_copy_in_redis_for_the_next_node(
        node_config, redis_cluster, redis_cluster_process):
    async with nodes(node_config, redis_cluster) as (a, b, c):
        session = make_session(random_tokens(70, 2), seed=2, tenant="acme")
        keys = [key for key, _ in session["chunks"]]
        await a.spill("acme", "s1", generation=1, ack="durable", **session)
        redis_cluster_process.flushall()  # a Redis restarted, or evicting under maxmemory

        got = await b.restore("acme", "s1")
        assert got.chunk_tiers == ["object"] * len(keys)
        await b.drain()  # the copies are placed in the background
        assert in_redis(redis_cluster, keys) == [True] * len(keys)

        again = await c.restore("acme", "s1")
        assert_same(again, session)
        assert again.chunk_tiers == ["redis"] * len(keys)
        assert not c.counters.hits["object"]


async def test_a_spill_names_by_key_alone_chunks_another_node_wrote(
        node_config, redis_cluster, redis_cluster_process):
    async with nodes(node_config, redis_cluster) as (a, b, c):
        tokens = random_tokens(70, 3)
        session = make_session(tokens, seed=3, tenant="acme")
        keys = [key for key, _ in session["chunks"]]
        by_key = {**session, "chunks": [(key, None) for key in keys]}
        await a.spill("acme", "s1", generation=1, ack="durable", **session)

        # b has not learnt a's chunks: it asks Redis (then the bucket) before refusing
        stored = await b.spill("acme", "s2", generation=1, ack="durable", **by_key)
        assert stored.receipt.chunks_deduped == len(keys) and stored.receipt.durable
        redis_cluster_process.flushall()
        await c.spill("acme", "s3", generation=1, ack="durable", **by_key)  # the bucket's
        for name in ("s2", "s3"):
            assert_same(await a.restore("acme", name), session)

        # the key binds the digest: other bytes for the same tokens are named by other keys
        other = make_session(tokens, seed=4, tenant="acme")
        with pytest.raises(ChunksNotHeld):
            await c.spill("acme", "s4", generation=1, ack="durable",
                          **{**other, "chunks": [(key, None) for key, _ in other["chunks"]]})


async def test_a_copy_in_redis_with_other_bytes_is_never_used(
        node_config, redis_cluster):
    async with nodes(node_config, redis_cluster, "ab") as (a, b):
        session = make_session(random_tokens(70, 5), seed=5, tenant="acme")
        keys = [key for key, _ in session["chunks"]]
        await a.spill("acme", "s1", generation=1, ack="durable", **session)
        wrong = make_session(random_tokens(70, 5), seed=6, tenant="acme")["chunks"][0][1]
        with RedisCluster.from_url(redis_cluster.replace("redis+cluster", "redis")) as client:
            client.set(PREFIX + keys[0], wrong)  # a valid chunk of these tokens, other bytes

        stored = await b.spill("acme", "s2", generation=1, ack="durable",
                               **{**session, "chunks": [(key, None) for key in keys]})
        assert stored.receipt.chunks_deduped == len(keys)
        got = await b.restore("acme", "s2")
        assert_same(got, session)
        assert got.chunk_tiers[0] != "redis" and b.counters.fallthrough_corrupt["redis"] > 0


async def test_with_redis_down_spills_are_durable_and_resumes_come_from_the_bucket(
        node_config, redis_cluster_factory):
    cluster = redis_cluster_factory(masters=3)
    async with nodes(node_config, cluster.url, "ab") as (a, b):
        for node in cluster.nodes:
            node.kill()
        session = make_session(random_tokens(70, 7), seed=7, tenant="acme")
        stored = await a.spill("acme", "s1", generation=1, ack="durable", **session)
        assert stored.receipt.durable
        assert a.counters.tier_errors["redis"] > 0  # the write-through failed, not the spill
        got = await b.restore("acme", "s1")
        assert_same(got, session)
        assert set(got.chunk_tiers) == {"object"}


async def test_stat_on_the_other_node_counts_its_resume_as_redis_hits(
        node_config, redis_cluster):
    def config(name: str) -> ServerConfig:
        return dataclasses.replace(node_config(name, redis_cluster), listen="127.0.0.1:0",
                                   replay="off")

    async with fleet_servers(config, "ab") as servers:
        session = make_session(random_tokens(70, 8), seed=8, tenant="acme", window=False)
        chunks = [data for _, data in session["chunks"]]
        async with AsyncClient(servers["a"]) as on_a, \
                AsyncClient(servers["b"]) as on_b:
            await on_a.spill("acme", "s1", TINY, session["token_ids"], chunks=chunks,
                             tail=session["tail"], generation=1, ack="durable")
            got = await on_b.restore("acme", "s1", want_window=False)
            assert [bytes(c) for c in got.chunks] == chunks
            tiers = {t.name: t for t in (await on_b.stat()).tiers}
            assert tiers["redis"].hits == len(chunks) and tiers["object"].hits == 0
