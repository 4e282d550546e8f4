"""Partial outages and the counters that show them, on real parts: a Redis Cluster with one
master killed keeps serving the other masters' keys from Redis; an S3 bucket that is gone
makes Evict to the object tier UNAVAILABLE (not RESOURCE_EXHAUSTED) until it is back;
every block an Evict writes into a tier counts as a demotion into it."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import boto3
import pytest
from redis.crc import key_slot

import kvtier
from kvstore.format.errors import DataLoss
from kvstore.session.manager import TierManager
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.redis import RedisTier, RedisTierConfig
from kvtier import AsyncClient, RetryPolicy
from tests.support.manager import make_session, random_tokens
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for

MB = 1 << 20
PREFIX = "kvtier:"
FAST_FAIL = RedisTierConfig(prefix=PREFIX, connect_timeout_s=0.2, socket_timeout_s=0.5,
                            retries=1, op_timeout_s=1.5)
NO_RETRY = RetryPolicy(attempts=1)
TOKENS = LAYOUT.chunk_tokens * 3 + 20


def slot_owners(cluster) -> dict[int, object]:
    """Slot -> the node (a ``RedisServer``) serving it, as the cluster says now."""
    by_address = {f"127.0.0.1:{node.port}": node for node in cluster.nodes}
    with cluster.nodes[0].client() as client:
        described = client.cluster("nodes")
    return {slot: by_address[address.split("@")[0]]
            for address, info in described.items()
            for start, end in info["slots"] for slot in range(int(start), int(end) + 1)}


def owner(owners: dict[int, object], key: str):
    return owners[key_slot((PREFIX + key).encode())]


def tier_up(stats, name: str) -> bool:
    return next(tier.available for tier in stats.tiers if tier.name == name)


async def test_a_dead_cluster_master_fails_only_its_keys(tmp_path, redis_cluster_factory):
    # A long node timeout keeps the cluster from declaring the master failed (which, with
    # full slot coverage required and no replica, would stop every slot) during the test.
    cluster = redis_cluster_factory(node_timeout_ms=60_000)
    redis = RedisTier(cluster.url, 8 * MB, FAST_FAIL)
    disk = DiskTier(tmp_path / "disk", 64 * MB)
    # Redis on top: every chunk is placed there first (and written back to disk).
    manager = await TierManager.open([redis, disk], disk.meta)
    try:
        old = make_session(random_tokens(16 * 12, seed=40), window=False)
        await manager.spill("t", "old", generation=1, **old)
        await manager.drain()
        in_redis = {key for key, _ in old["chunks"]}
        assert all(manager.where(key) == ["redis", "disk"] for key in in_redis)
        owners = slot_owners(cluster)
        victim = cluster.nodes[1]
        lost = {key for key in in_redis if owner(owners, key) is victim}
        assert lost and lost < in_redis  # the victim and another master hold some of them
        victim.kill()

        result = await manager.restore("t", "old")
        assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in old["chunks"]]
        await manager.drain()  # the restore's promotions
        tiers = dict(zip([key for key, _ in old["chunks"]], result.chunk_tiers, strict=True))
        assert {key for key in in_redis if tiers[key] == "disk"} == lost  # fell through
        assert {key for key in in_redis if tiers[key] == "redis"} == in_redis - lost
        stats = await manager.stat()
        assert stats.counters["hits"]["redis"] == len(in_redis - lost)
        assert stats.counters["fallthrough_unavailable"]["redis"] == len(lost)
        assert tier_up(stats, "redis")  # not marked down: the other masters serve

        # New blocks go on into Redis, except those whose master is the dead one.
        new = make_session(random_tokens(16 * 6, seed=41), window=False)
        await manager.spill("t", "new", generation=1, **new)
        new_keys = {key for key, _ in new["chunks"]}
        placed = {key for key in new_keys if manager.where(key)[0] == "redis"}
        assert placed == {key for key in new_keys if owner(owners, key) is not victim}
        assert placed
        for key, data in new["chunks"]:
            if key in placed:  # really in Redis: read back from the master that owns it
                with owner(owners, key).client() as client:
                    assert client.get(PREFIX + key) == bytes(data)
        await manager.drain()  # their write-back read them from Redis
        assert tier_up(await manager.stat(), "redis")

        # A chunk with no copy but on the dead master is lost, as before.
        await disk.delete(sorted(lost)[0])
        with pytest.raises(DataLoss, match="redis unavailable"):
            await manager.restore("t", "old")
        assert tier_up(await manager.stat(), "redis")

        for node in cluster.nodes:  # the whole cluster out: now the tier is marked down
            node.kill()
        result = await manager.restore("t", "new")  # from the disk copies (write-back)
        assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in new["chunks"]]
        assert "redis" not in result.chunk_tiers
        assert not tier_up(await manager.stat(), "redis")
    finally:
        await manager.close()


async def _scrape(port: int) -> dict[str, float]:
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("kvtier_")}


async def test_every_evict_counts_its_demotions(tmp_path):
    async with running_server(tmp_path, metrics_port=0) as (server, target), \
            AsyncClient(target) as kv:
        port = server.start_metrics(0, "127.0.0.1")
        chunks = {}
        for index, sid in enumerate(("s1", "s2")):
            await kv.spill("acme", sid, LAYOUT.name, tokens_for(TOKENS, seed=index),
                           streams_for(LAYOUT, TOKENS, seed=index), generation=1)
            chunks[sid] = len((await server.manager.get_manifest("acme", sid)).chunk_keys)
        assert (await kv.evict("acme", "s1", "object")).tier == "object"
        await kv.stat()  # refreshes the snapshot the endpoint exports
        samples = await _scrape(port)
        assert samples['kvtier_demotions_total{tier="object"}'] == chunks["s1"]
        await kv.evict("acme", "s2", "object")
        await kv.stat()
        samples = await _scrape(port)
        assert samples['kvtier_demotions_total{tier="object"}'] == chunks["s1"] + chunks["s2"]
        for sid in chunks:
            keys = (await server.manager.get_manifest("acme", sid)).chunk_keys
            assert all(server.manager.where(key) == ["object"] for key in keys)


async def test_evict_to_a_missing_bucket_is_unavailable_until_it_exists(
        tmp_path, monkeypatch, s3_server, s3_bucket, s3_credentials):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    s3 = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
    async with running_server(tmp_path, s3_endpoint=s3_server, s3_bucket=s3_bucket,
                              s3_region=s3_credentials["region_name"]) as (server, target), \
            AsyncClient(target, retry=NO_RETRY) as kv:
        await kv.spill("acme", "s1", LAYOUT.name, tokens_for(TOKENS),
                       streams_for(LAYOUT, TOKENS), generation=1)
        s3.delete_bucket(Bucket=s3_bucket)  # empty: write-back went to the disk tier
        for _ in range(3):  # the first call finds it gone, later ones skip the tier
            with pytest.raises(kvtier.TierUnavailable) as raised:
                await kv.evict("acme", "s1", "object")
            message = str(raised.value)
            assert message.startswith("UNAVAILABLE") and f"{s3_bucket!r}" in message
            assert s3_credentials["aws_secret_access_key"] not in message
        keys = (await server.manager.get_manifest("acme", "s1")).chunk_keys
        assert all("object" not in server.manager.where(key) for key in keys)

        s3.create_bucket(Bucket=s3_bucket)  # no restart: the tier is tried again
        deadline = time.monotonic() + 30
        while True:
            try:
                reply = await kv.evict("acme", "s1", "object")
                break
            except kvtier.TierUnavailable:  # the tier stack's cooldown has not ended yet
                assert time.monotonic() < deadline, "Evict never succeeded"
                await asyncio.sleep(0.1)
        assert reply.tier == "object"
        assert all(server.manager.where(key) == ["object"] for key in keys)
        listed = s3.list_objects_v2(Bucket=s3_bucket).get("Contents", [])
        assert len(listed) == len(keys)
