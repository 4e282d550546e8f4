"""The server with its Redis tier on (the real redis-server fixture): sessions demoted to
Redis come back from it, and from the disk tier when Redis goes away."""

from __future__ import annotations

from kvtier import AsyncClient
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    streams_for,
    tokens_for,
)

TOKENS = 2 * LAYOUT.chunk_tokens + 50


async def test_restore_from_redis_and_through_an_outage(tmp_path, redis_server,
                                                        redis_process):
    sessions = {f"s{i}": (tokens_for(TOKENS, seed=i), streams_for(LAYOUT, TOKENS, seed=i))
                for i in range(3)}
    # A host tier smaller than the sessions: spills push older chunks down to Redis.
    async with running_server(tmp_path, redis_url=redis_server, redis_preset="loopback",
                              host_bytes=96 << 10, redis_bytes=64 << 20) as (server, target), \
            AsyncClient(target) as kv:
        assert [t.name for t in server.manager.tiers] == ["host", "redis", "disk", "object"]
        for name, (tokens, persistent) in sessions.items():
            await kv.spill("acme", name, LAYOUT.name, tokens, persistent, generation=1)
        await server.manager.drain()  # write-back: a durable copy of every chunk on disk
        assert "redis" in (await kv.stat("acme", "s0")).session.tiers
        with redis_process.client() as redis:
            assert redis.keys("kvtier:*")
        tokens, persistent = sessions["s0"]
        from_redis = await kv.restore("acme", "s0")
        assert from_redis.tier == "redis"
        assert_streams_equal(from_redis.persistent, persistent)

        await kv.evict("acme", "s0", "redis")  # the restore promoted s0 to host again
        redis_process.kill()
        from_disk = await kv.restore("acme", "s0")
        assert from_disk.tier == "disk"
        assert_streams_equal(from_disk.persistent, persistent)
        stat = await kv.stat()
        assert {t.name: t.available for t in stat.tiers}["redis"] is False
