"""RedisTier against a real redis-server (and a real three-master cluster)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest
import redis

from kvstore.format.errors import ChunkNotFound, InvalidRequest, TierFull, TierUnavailable
from kvstore.tiers.common import Availability
from kvstore.tiers.redis import RedisTier, RedisTierConfig
from tests.support.clock import ManualClock

FAST_FAIL = RedisTierConfig(connect_timeout_s=0.2, socket_timeout_s=0.5, retries=1,
                            op_timeout_s=1.5, breaker_cooldown_s=0.2)


async def test_round_trip_namespaces_and_buffer_types(redis_server):
    tier = RedisTier(redis_server, 1 << 20, RedisTierConfig(prefix="a:"))
    other = RedisTier(redis_server, 1 << 20, RedisTierConfig(prefix="b:"))
    try:
        await tier.put("k1", b"bytes")
        await tier.put("k2", bytearray(b"bytearray"))
        await tier.put("k3", memoryview(b"xxview")[2:])
        await other.put("k1", b"other namespace")
        assert await tier.get("k1") == b"bytes"
        assert await tier.get("k2") == b"bytearray"
        assert await tier.get("k3") == b"view"
        assert await other.get("k1") == b"other namespace"
        assert sorted([k async for k in tier.keys()]) == ["k1", "k2", "k3"]  # noqa: SIM118
        assert await tier.count() == 3
        assert tier.used_bytes == 5 + 9 + 4
        assert await tier.contains("k2") and not await tier.contains("nope")
        with pytest.raises(ChunkNotFound):
            await tier.get("nope")
        with pytest.raises(InvalidRequest):
            await tier.put("", b"x")
    finally:
        await tier.close()
        await other.close()


async def test_capacity_overwrite_and_delete(redis_server):
    tier = RedisTier(redis_server, 1000)
    try:
        await tier.put("a", b"1" * 600)
        with pytest.raises(TierFull):
            await tier.put("b", b"2" * 401)
        await tier.put("a", b"3" * 100)
        await tier.put("b", b"4" * 900)
        assert tier.used_bytes == 1000
        assert await tier.delete("a") == 100
        assert await tier.delete("a") == 0
        assert tier.used_bytes == 900
        assert await tier.get("b") == b"4" * 900
    finally:
        await tier.close()


async def test_concurrent_puts_never_overfill(redis_server):
    tier = RedisTier(redis_server, 10_000)
    try:
        results = await asyncio.gather(
            *[tier.put(f"k{i}", b"x" * 1000) for i in range(25)], return_exceptions=True)
        stored = sum(result is None for result in results)
        assert all(r is None or isinstance(r, TierFull) for r in results)
        assert stored == 10 and tier.used_bytes == 10_000 and await tier.count() == 10
    finally:
        await tier.close()


async def test_ttl_expiry_and_accounting(redis_server):
    clock = ManualClock()
    tier = RedisTier(redis_server, 1 << 20, clock=clock)
    try:
        await tier.put("short", b"s" * 10, ttl_s=30)
        await tier.put("long", b"l" * 10, ttl_s=3600)
        await tier.put("forever", b"f" * 10)
        # Redis holds the TTLs the tier set (less the moments since the SETs).
        assert 29 < await tier.ttl_s("short") <= 30
        assert 3599 < await tier.ttl_s("long") <= 3600
        assert await tier.ttl_s("forever") is None
        assert tier.used_bytes == 30
        clock.advance(29.5)
        assert tier.used_bytes == 30
        clock.advance(1)  # past short's deadline: the accounting drops it
        assert tier.used_bytes == 20
        # Redis expires it by its own clock: an expiry time already past does so now.
        with redis.Redis.from_url(redis_server) as client:
            assert client.pexpireat("kvtier:short", 1)
        assert not await tier.contains("short")
        with pytest.raises(ChunkNotFound):
            await tier.get("short")
        assert await tier.contains("long") and tier.used_bytes == 20
        await tier.put("long", b"l" * 10)  # an overwrite without a TTL clears the TTL
        assert await tier.ttl_s("long") is None
        with pytest.raises(InvalidRequest):
            await tier.put("bad", b"x", ttl_s=-1)
    finally:
        await tier.close()


async def test_default_ttl_from_config(redis_server):
    tier = RedisTier(redis_server, 1 << 20, RedisTierConfig(default_ttl_s=30))
    try:
        await tier.put("k", b"v")
        assert 0 < await tier.ttl_s("k") <= 30
    finally:
        await tier.close()


async def test_other_writers_are_seen_on_read_and_by_resync(redis_server, opened):
    tier = RedisTier(redis_server, 1 << 20, RedisTierConfig(prefix="ns:"))
    try:
        await tier.put("mine", b"m" * 50)
        await tier.put("gone", b"g" * 30)
        with redis.Redis.from_url(redis_server) as client:
            client.delete("ns:gone")
            client.set("ns:mine", b"M" * 70)
            client.set("ns:theirs", b"t" * 5, px=60_000)
            client.set("elsewhere", b"not in the namespace")
            client.hset("ns:hash", "field", "a hash is not a value")
        with pytest.raises(ChunkNotFound):
            await tier.get("gone")
        assert tier.used_bytes == 50
        assert await tier.get("mine") == b"M" * 70
        assert tier.used_bytes == 70
        with pytest.raises(TierUnavailable):
            await tier.get("hash")
        with redis.Redis.from_url(redis_server) as client:
            client.delete("ns:hash")
        fresh = opened.adopt(RedisTier(redis_server, 1 << 20, RedisTierConfig(prefix="ns:")))
        assert await fresh.resync() == 75 == fresh.used_bytes
        assert 0 < await fresh.ttl_s("theirs") <= 60
        assert await fresh.delete("theirs") == 5
        assert fresh.used_bytes == 70
        await opened.close(fresh)
    finally:
        await tier.close()


def test_bad_urls_and_prefixes():
    with pytest.raises(InvalidRequest):
        RedisTier("http://127.0.0.1:1", 10)
    with pytest.raises(InvalidRequest):
        RedisTier("redis+cluster://127.0.0.1:1", 10, RedisTierConfig(prefix="{tag}:"))


async def test_outage_raises_promptly_and_recovers(redis_process, redis_server, caplog):
    tier = RedisTier(redis_server, 1 << 20, FAST_FAIL)
    try:
        await tier.put("before", b"b" * 100)
        redis_process.kill()
        caplog.set_level(logging.WARNING, logger="kvstore.tiers.redis")
        for operation in (lambda: tier.get("before"), lambda: tier.put("during", b"d"),
                          lambda: tier.delete("before"), lambda: tier.contains("before")):
            started = time.monotonic()
            with pytest.raises(TierUnavailable):
                await operation()
            assert time.monotonic() - started < 3 * FAST_FAIL.op_timeout_s  # bounded, not hung
        assert not tier.health.available and not await tier.ping()
        assert (await tier.stats()).available is False
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1  # logged once per outage, not once per failed call
        assert tier.used_bytes == 100  # a failed delete changed nothing

        redis_process.restart()  # same port, no persistence: the data is gone
        await asyncio.sleep(FAST_FAIL.breaker_cooldown_s)  # then one call probes again
        with pytest.raises(ChunkNotFound):
            await tier.get("before")
        assert tier.health.available and tier.used_bytes == 0
        await tier.put("after", b"a" * 10)
        assert await tier.get("after") == b"a" * 10
        assert await tier.delete("after") == 10  # the delete script is reloaded by itself
        assert any("available again" in r.getMessage() for r in caplog.records)
    finally:
        await tier.close()


async def test_a_hung_server_times_out_instead_of_hanging(redis_server_factory):
    server = redis_server_factory()
    tier = RedisTier(server.url, 1 << 20, FAST_FAIL)
    try:
        await tier.put("k", b"v")
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(TierUnavailable):
                await tier.get("k")
            assert time.monotonic() - started < 3 * FAST_FAIL.op_timeout_s  # bounded, not hung
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        await asyncio.sleep(FAST_FAIL.breaker_cooldown_s)  # then one call probes again
        assert await tier.get("k") == b"v"
    finally:
        await tier.close()


async def test_persistent_server_keeps_values_across_restart(redis_server_factory):
    server = redis_server_factory(persistent=True)
    tier = RedisTier(server.url, 1 << 20, FAST_FAIL)
    try:
        await tier.put("k", b"durable" * 10)
        server.kill()
        server.restart()
        assert await tier.get("k") == b"durable" * 10
        assert tier.used_bytes == 70
    finally:
        await tier.close()


async def test_cluster_spreads_keys_over_every_master(redis_cluster, redis_cluster_process, opened):
    clock = ManualClock()
    tier = RedisTier(redis_cluster, 1 << 20, clock=clock)
    assert tier.cluster
    try:
        for i in range(60):
            await tier.put(f"chunk-{i}", bytes([i]) * 100)
        await tier.put("short", b"s", ttl_s=30)
        await tier.put("long", b"l", ttl_s=60)
        for i in range(60):
            assert await tier.get(f"chunk-{i}") == bytes([i]) * 100
        per_node, owners = [], []
        for node in redis_cluster_process.nodes:
            with node.client() as client:
                per_node.append(client.dbsize())
                slot = client.cluster("keyslot", "kvtier:chunk-7")
                owners.append(client.cluster("countkeysinslot", slot))
        assert sum(per_node) == 62 and all(n > 0 for n in per_node)
        assert sorted(owners) == [0, 0, 1]  # the key lives on exactly one master
        assert await tier.count() == 62
        assert 59 < await tier.ttl_s("long") <= 60
        clock.advance(31)  # past short's deadline, and Redis expires it on its master now
        expired_on = []
        for node in redis_cluster_process.nodes:
            with node.client() as client:
                if client.cluster("countkeysinslot", client.cluster("keyslot", "kvtier:short")):
                    expired_on.append(client.pexpireat("kvtier:short", 1))
        assert expired_on == [True]
        with pytest.raises(ChunkNotFound):
            await tier.get("short")
        assert await tier.delete("chunk-3") == 100
        assert not await tier.contains("chunk-3")
        assert tier.used_bytes == 59 * 100 + 1
        fresh = opened.adopt(RedisTier(redis_cluster, 1 << 20))
        assert await fresh.resync() == tier.used_bytes
        await opened.close(fresh)
    finally:
        await tier.close()


def test_availability_logs_a_flapping_medium_once_per_interval(caplog):
    health = Availability(logging.getLogger("test.availability"), "medium", log_interval_s=60)
    caplog.set_level(logging.WARNING, logger="test.availability")
    for _ in range(5):
        health.failed("GET", ConnectionError("refused"))
        assert not health.available
        health.succeeded()
        assert health.available
    assert health.failures == 5
    levels = [record.levelno for record in caplog.records]
    assert levels == [logging.ERROR, logging.WARNING]


@pytest.mark.slow
async def test_cluster_master_outage_fails_only_its_keys(redis_cluster_factory):
    # A long node timeout keeps the cluster from declaring the master failed (which, with
    # no replica to promote, would stop every slot) while the test runs.
    cluster = redis_cluster_factory(node_timeout_ms=60_000)
    tier = RedisTier(cluster.url, 1 << 20, FAST_FAIL)
    try:
        keys = [f"k{i}" for i in range(24)]
        for key in keys:
            await tier.put(key, key.encode())
        victim = cluster.nodes[1]
        with victim.client() as client:
            on_victim = {key for key in keys
                         if client.cluster("countkeysinslot",
                                           client.cluster("keyslot", "kvtier:" + key))}
        assert 0 < len(on_victim) < len(keys)
        victim.kill()
        for key in keys:
            if key in on_victim:
                with pytest.raises(TierUnavailable):
                    await tier.get(key)
            else:
                assert await tier.get(key) == key.encode()
        victim.restart()  # no persistence: its keys are gone, its slots come back
        deadline = time.monotonic() + 30
        probe = sorted(on_victim)[0]
        while True:
            try:
                await tier.put(probe, probe.encode())  # served by the restarted master
                await tier.delete(probe)
                break
            except TierUnavailable:
                assert time.monotonic() < deadline, "the cluster did not recover"
                await asyncio.sleep(0.2)
        for key in keys:
            if key in on_victim:
                with pytest.raises(ChunkNotFound):
                    await tier.get(key)
            else:
                assert await tier.get(key) == key.encode()
        assert tier.used_bytes == sum(len(k) for k in keys if k not in on_victim)
        assert tier.health.available
    finally:
        await tier.close()


def test_a_redis_url_password_appears_in_no_log_line_or_error(caplog):
    with pytest.raises(InvalidRequest) as err:
        RedisTier("http://:hunter2@localhost:1", capacity_bytes=1 << 20)
    assert "hunter2" not in str(err.value) and "<secret>" in str(err.value)
    tier = RedisTier("redis://:hunter2@127.0.0.1:1/0", capacity_bytes=1 << 20)
    assert "hunter2" not in tier.health.what and "<secret>" in tier.health.what


async def test_an_attribute_error_inside_redis_py_is_an_outage_and_ours_is_a_bug(redis_server,
                                                                                  opened):
    """A command written to a connection a failover closed escapes redis-py as an
    AttributeError; only one raised inside redis-py is taken for an outage."""
    from types import SimpleNamespace

    from redis.asyncio.connection import Connection

    tier = opened.adopt(RedisTier(redis_server, 1 << 20, FAST_FAIL))

    async def dead_connection():
        await Connection.send_packed_command(SimpleNamespace(), b"PING")

    async def our_bug():
        return SimpleNamespace().missing

    with pytest.raises(AttributeError):
        await tier._attempt("get", our_bug, None)
    with pytest.raises(TierUnavailable, match="failed"):
        await tier._attempt("get", dead_connection, None)
