"""Prefix reuse across a fleet (docs/fleet.md, "Prefix reuse across the fleet"): with
metadata = "shared", Lookup on one node finds a prefix another node spilled, through
Redis's chain pointers (a real three-master Redis Cluster) or, Redis flushed, through
the bucket (moto's S3 server), within a bounded number of probes counted by the tiers;
never another tenant's; and Fork of a session another node spilled. Real servers'
stores (``open_manager``), and real servers over gRPC for Lookup."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from redis.cluster import RedisCluster

from kvstore.format.errors import PreconditionFailed
from kvstore.format.keys import block_key, split_block_key
from kvstore.tiers.redis import RedisTier, RedisTierConfig
from kvtier import AsyncClient
from services.server.config import ServerConfig
from tests.support import hot_tier
from tests.support.fleet import fleet_servers
from tests.support.hot_tier import PREFIX, assert_same, nodes
from tests.support.manager import TINY, make_session, random_tokens
from tests.support.service import LAYOUT, assert_streams_equal, streams_for, tokens_for

C = TINY.chunk_tokens
node_config = hot_tier.node_config  # the fixture: three nodes' configs


def probes(manager, name: str) -> dict[str, int]:
    """The probe counters of the manager's tier ``name``, read and reset."""
    tier = next(t for t in manager.tiers if t.name == name)
    counted = dict(tier.probes)
    tier.probes.clear()
    return counted


def longer(tokens: np.ndarray, extra: int, seed: int) -> np.ndarray:
    """``tokens`` then ``extra`` more: a request that shares ``tokens`` as its prefix."""
    return np.concatenate([tokens, random_tokens(extra, seed)])


async def lookup(manager, tokens, tenant: str = "acme", **options):
    return await manager.lookup_fleet(tenant, TINY.layout_id, tokens, **options)


async def test_a_prefix_spilled_on_a_is_found_on_b_through_redis_then_the_bucket(
        node_config, redis_cluster, redis_cluster_process):
    async with nodes(node_config, redis_cluster) as (a, b, c):
        system = random_tokens(4 * C, 1)  # a shared system prompt: four whole chunks
        session = make_session(system, seed=1, tenant="acme")
        keys = [key for key, _ in session["chunks"]]
        await a.spill("acme", "s1", generation=1, ack="durable", **session)
        with RedisCluster.from_url(redis_cluster.replace("redis+cluster", "redis")) as client:
            pointers = [client.get(f"{PREFIX}chain/{split_block_key(key)[0]}") for key in keys]
        assert pointers == [split_block_key(key)[1].hex().encode() for key in keys]

        request = longer(system, 3 * C + 5, 2)  # the prompt, then this user's turn
        assert b.lookup("acme", TINY.layout_id, request).tokens_held == 0  # local: no I/O
        found = await lookup(b, request)
        assert found.tokens_held == 4 * C
        assert [chunk.block_key for chunk in found.chunks] == keys
        assert all(chunk.tiers[0] == "redis" for chunk in found.chunks)
        assert probes(b, "redis")["EXISTS"] == 4  # the four found, confirmed
        assert probes(b, "object") == {"LIST": 1}  # the fifth: held nowhere, the end

        # b starts a session from the prefix: the prompt's chunks by key, its own by bytes
        own = make_session(request, seed=3, tenant="acme")
        named = {**own, "chunks": [(key, None) for key in keys] + own["chunks"][4:]}
        stored = await b.spill("acme", "s2", generation=1, ack="durable", **named)
        assert stored.receipt.chunks_deduped == 4
        want = {**own, "chunks": session["chunks"] + own["chunks"][4:]}
        assert_same(await b.restore("acme", "s2"), want)

        redis_cluster_process.flushall()  # Redis lost everything: the bucket answers
        found = await lookup(c, request)  # now all of it: b's session named the rest
        assert found.tokens_held == 7 * C
        assert [chunk.block_key for chunk in found.chunks] == [k for k, _ in want["chunks"]]
        assert all(chunk.tiers == ("object",) for chunk in found.chunks)
        assert probes(c, "object") == {"LIST": 7}  # in groups of 1, 2, 4
        by_key = {**want, "chunks": [(key, None) for key, _ in want["chunks"]]}
        await c.spill("acme", "s3", generation=1, ack="durable", **by_key)
        assert_same(await c.restore("acme", "s3"), want)
        assert_same(await a.restore("acme", "s2"), want)


async def test_lookup_on_b_never_reports_another_tenants_prefix(node_config, redis_cluster):
    async with nodes(node_config, redis_cluster, "ab") as (a, b):
        tokens = random_tokens(4 * C, 4)
        acme = make_session(tokens, seed=4, tenant="acme")
        await a.spill("acme", "s1", generation=1, ack="durable", **acme)
        # the same tokens stored by another tenant, with other bytes
        evil = make_session(tokens, seed=5, tenant="evil")
        await a.spill("evil", "s1", generation=1, ack="durable", **evil)

        assert (await lookup(b, tokens, "other")).tokens_held == 0
        assert (await lookup(b, tokens, model_fingerprint="other-weights")).tokens_held == 0
        assert (await lookup(b, tokens, dedupe_domain="public")).tokens_held == 0
        for tenant, session in (("acme", acme), ("evil", evil)):
            found = await lookup(b, tokens, tenant)
            assert [chunk.block_key for chunk in found.chunks] == \
                [key for key, _ in session["chunks"]]


async def test_fork_on_b_of_a_session_a_spilled_then_both_diverge_and_restore_on_c(
        node_config, redis_cluster):
    async with nodes(node_config, redis_cluster) as (a, b, c):
        tokens = random_tokens(4 * C + 6, 6)
        source = make_session(tokens, seed=6, tenant="acme")
        await a.spill("acme", "src", generation=1, ack="durable", **source)

        forked = await b.fork("acme", "src", "branch", upto_tokens=2 * C + 3)
        assert (forked.generation, forked.num_tokens) == (1, 2 * C)
        assert list(forked.chunk_keys) == [key for key, _ in source["chunks"][:2]]
        with pytest.raises(PreconditionFailed):  # the manifest is in the bucket: c sees it
            await c.fork("acme", "src", "branch", upto_tokens=C)
        got = await c.restore("acme", "branch")
        assert [bytes(x) for x in got.chunks] == [bytes(d) for _, d in source["chunks"][:2]]
        assert got.replay_needed  # no window at the fork point: Resume replays

        # diverge: the branch goes on with other tokens past the fork, the source too
        theirs = np.concatenate([tokens[: 2 * C], random_tokens(2 * C + 9, 7)])
        branch = make_session(theirs, seed=7, tenant="acme")
        branch["chunks"][:2] = [(key, None) for key, _ in source["chunks"][:2]]
        await b.spill("acme", "branch", generation=2, ack="durable", **branch)
        grown = make_session(longer(tokens, 2 * C, 8), seed=6, tenant="acme")
        await a.spill("acme", "src", generation=2, ack="durable", **grown)

        assert_same(await c.restore("acme", "src"), grown)
        branch["chunks"][:2] = source["chunks"][:2]
        assert_same(await c.restore("acme", "branch"), branch)

        whole = await b.fork("acme", "src", "copy", upto_tokens=len(grown["token_ids"]))
        assert whole.window_key is None  # the window stays on a, the node that holds it
        assert_same(await c.restore("acme", "copy"), grown)


async def test_probes_are_bounded_for_a_long_sequence(
        node_config, redis_cluster, redis_cluster_process):
    async with nodes(node_config, redis_cluster) as (a, b, c):
        million = random_tokens(1 << 20, 9)  # 65536 chunks
        found = await lookup(b, million)  # nothing held: one round and one LIST
        assert found.tokens_held == 0
        assert probes(b, "redis") == {"GET": 8, "round trip": 1}
        assert probes(b, "object") == {"LIST": 1}

        held = 200
        session = make_session(million[: held * C], seed=9, tenant="acme", window=False)
        await a.spill("acme", "long", generation=1, ack="durable", **session)
        found = await lookup(b, million)
        assert found.tokens_held == held * C
        redis = probes(b, "redis")
        # rounds of 8, 16, .. 128 (248 keys): the fifth is not held whole, and ends it
        assert redis == {"GET": 248, "EXISTS": held, "round trip": 10}
        assert probes(b, "object") == {"LIST": 1}

        redis_cluster_process.flushall()  # only the bucket: at most 64 LISTs a lookup
        first = await lookup(c, million)
        assert first.tokens_held == 64 * C  # shorter, never wrong
        assert probes(c, "object") == {"LIST": 64}
        second = await lookup(c, million)  # what the first learnt is known: it goes on
        assert second.tokens_held == 128 * C
        assert probes(c, "object") == {"LIST": 64}
        assert [chunk.block_key for chunk in second.chunks] == \
            [key for key, _ in session["chunks"][:128]]


async def test_without_shared_metadata_a_lookup_asks_no_tier(node_config, redis_cluster):
    async with nodes(node_config, redis_cluster, "a", metadata="local") as (a,):
        tokens = random_tokens(4 * C, 10)
        assert (await lookup(a, tokens)).tokens_held == 0
        assert all(not tier.probes for tier in a.tiers)


async def test_lookup_over_grpc_on_b_then_a_spill_sends_only_the_chunks_past_it(
        node_config, redis_cluster):
    def config(name: str) -> ServerConfig:
        return dataclasses.replace(node_config(name, redis_cluster), listen="127.0.0.1:0",
                                   replay="off")

    async with fleet_servers(config, "abc") as servers:
        chunk = LAYOUT.chunk_tokens
        system = tokens_for(3 * chunk, seed=11)
        full = streams_for(LAYOUT, len(system), seed=11)
        async with AsyncClient(servers["a"]) as on_a, \
                AsyncClient(servers["b"]) as on_b, AsyncClient(servers["c"]) as on_c:
            await on_a.spill("acme", "s1", LAYOUT.name, system, full, generation=1,
                             ack="durable")
            assert await on_b.lookup("evil", LAYOUT.name, system) == 0
            assert await on_b.lookup("acme", LAYOUT.name, system) == 3 * chunk
            sent = await on_b.spill("acme", "s2", LAYOUT.name, system, full, generation=1,
                                    ack="durable")
            assert (sent.chunks_sent, sent.chunks_deduped) == (0, 3)
            assert_streams_equal((await on_c.restore("acme", "s2")).persistent, full)


async def test_redis_chain_pointers_follow_their_chunks(redis_cluster):
    tier = RedisTier(redis_cluster, 1 << 20, RedisTierConfig(prefix="ptr:", chain_index=True))
    chain = "ab" * 16
    old, new = block_key(chain, b"\1" * 32), block_key(chain, b"\2" * 32)
    raw = RedisCluster.from_url(redis_cluster.replace("redis+cluster", "redis"))
    try:
        assert await tier.find_chains([chain, "cd" * 16]) == [None, None]
        await tier.put(old, b"x" * 10)
        await tier.put("win/acme/s1/1", b"w")  # a window blob: no pointer
        assert await tier.find_chains([chain, "cd" * 16]) == [old, None]
        assert sorted([key async for key in tier.keys()]) == [old, "win/acme/s1/1"]
        assert tier.used_bytes == 11  # pointers are not counted
        await tier.put(new, b"y" * 10)  # another version: the pointer names the last
        assert await tier.find_chains([chain]) == [new]
        await tier.delete(old)  # not the one named: the pointer stays
        assert await tier.find_chains([chain]) == [new]
        raw.delete("ptr:" + new)  # gone behind the tier's back (maxmemory, a flush)
        assert await tier.find_chains([chain]) == [None]  # EXISTS confirms each pointer
        await tier.put(new, b"y" * 10)
        await tier.delete(new)
        assert raw.get(f"ptr:chain/{chain}") is None
    finally:
        raw.close()
        await tier.close()
