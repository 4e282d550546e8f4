"""Retained chunks over a real server: chunks no session names any more stay
as evictable cache, accounted to their dedupe domain, and give way under every pressure
(a full medium, their TTL, the tenant's quota); their marks survive a restart."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.format.errors import PermissionDenied, QuotaExceeded, TierFull
from kvstore.format.keys import dedupe_scope
from kvtier import AsyncClient
from kvtier import codec as cc
from tests.support.security import dev_set, secured_server
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    streams_for,
    tokens_for,
)

C = LAYOUT.chunk_tokens
CHUNKS = 16
TOKENS = CHUNKS * C  # ~300 KB on disk
# An 8 MiB medium (4 MiB of it the disk tier's reserve) under a disk tier of 1 GiB.
SMALL_MEDIUM = {"host_bytes": "1MiB", "disk_bytes": "1GiB", "object_bytes": 0,
                "disk_segment_bytes": "256KiB", "disk_reclaim_dead_fraction": 0.5,
                "disk_reclaim_interval_s": 0.05}


async def spill(kv: AsyncClient, n: int, tenant: str = "acme", **options) -> None:
    await kv.spill(tenant, f"s{n}", LAYOUT.name, tokens_for(TOKENS, seed=n),
                   streams_for(LAYOUT, TOKENS, seed=n), generation=1, **options)


async def held(kv: AsyncClient, n: int, tenant: str = "acme") -> int:
    return await kv.lookup(tenant, LAYOUT.name, tokens_for(TOKENS, seed=n))


async def restores_exactly(kv: AsyncClient, kept: list[int]) -> None:
    for n in kept:
        restored = await kv.restore("acme", f"s{n}", want_window=False)
        assert_streams_equal(restored.persistent, streams_for(LAYOUT, TOKENS, seed=n))


def session_bytes(n: int, tenant: str = "acme") -> tuple[int, int]:
    """(bytes of the session's chunks, of its chunks and tail) as the server stores them."""
    tokens = tokens_for(TOKENS, seed=n)
    encoded = cc.encode_session(LAYOUT, tokens, streams_for(LAYOUT, TOKENS, seed=n),
                                scope=dedupe_scope(tenant))
    chunks = sum(len(c) for c in encoded.chunks.values())
    return chunks, chunks + len(encoded.tail)


@pytest.mark.parametrize("ttl", [{}, {"retain_ttl_s": 600.0}], ids=["no-ttl", "long-ttl"])
async def test_retained_chunks_give_way_when_the_medium_fills(tmpfs_factory, ttl):
    # a retain TTL is how long they may stay, not a floor: a full medium takes them sooner
    medium = tmpfs_factory(8)
    async with running_server(medium, **SMALL_MEDIUM, **ttl) as (_, target), \
            AsyncClient(target) as kv:
        stored = []
        for n in range(60):
            try:
                await spill(kv, n, ack="durable")
            except TierFull:
                break
            stored.append(n)
        else:
            pytest.fail("60 spills never filled an 8 MiB tmpfs")
        assert len(stored) >= 4
        deleted, kept = stored[: len(stored) // 2], stored[len(stored) // 2:]
        full = await kv.stat()  # the refused spill's chunks already placed are retained too
        for n in deleted:
            assert (await kv.delete("acme", f"s{n}")).chunks_freed == 0  # retained
        before = await kv.stat(usage_of="acme")
        assert before.retained_chunks == full.retained_chunks + CHUNKS * len(deleted)
        assert before.retained_bytes == full.retained_bytes + sum(
            session_bytes(n)[0] for n in deleted)
        assert before.tenant_usage.retained_bytes == before.retained_bytes
        assert await held(kv, deleted[0]) == TOKENS  # looked up: used now, so kept longest
        more = [100, 101, 102]
        for n in more:  # refused while the medium is full, until retained chunks gave way
            for _ in range(300):
                try:
                    await spill(kv, n, ack="durable")
                    break
                except TierFull:
                    await asyncio.sleep(0.1)
            else:
                pytest.fail(f"spill {n} still refused: the retained chunks never gave way")
        after = await kv.stat()
        assert after.retained_chunks < before.retained_chunks
        assert await held(kv, deleted[1]) < TOKENS  # the least recently used went first
        await restores_exactly(kv, kept + more)


async def test_retained_chunks_expire_after_retain_ttl_s(tmp_path):
    async with running_server(tmp_path, retain_ttl_s=2.0) as (_, target), \
            AsyncClient(target) as kv:
        await spill(kv, 1)
        await kv.delete("acme", "s1")
        assert await held(kv, 1) == TOKENS
        assert (await kv.stat()).retained_chunks == CHUNKS
        for _ in range(300):  # (a lookup would count as a use: Stat does not)
            if (await kv.stat()).retained_chunks == 0:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("retained chunks outlived retain_ttl_s")
        assert await held(kv, 1) == 0
        stat = await kv.stat()
        assert stat.retained_bytes == 0
        assert all(t.items == 0 for t in stat.tiers)  # freed, not moved down


async def test_a_tenant_over_its_quota_loses_its_retained_chunks_first(tmp_path):
    chunks, stored = session_bytes(1)
    limit = stored + stored // 2  # one session and half of another
    quota = {"quota": {"acme": {"durable_bytes": limit}}}
    async with running_server(tmp_path, **quota) as (_, target), AsyncClient(target) as kv:
        await spill(kv, 1)
        await spill(kv, 1, tenant="bob")  # the same tokens in another domain
        await kv.delete("acme", "s1")
        await kv.delete("bob", "s1")
        usage = (await kv.stat(usage_of="acme")).tenant_usage
        assert (usage.durable_bytes, usage.retained_bytes) == (0, chunks)
        await spill(kv, 2)  # fits the limit only once the retained chunks make room
        usage = (await kv.stat(usage_of="acme")).tenant_usage
        assert usage.durable_bytes == session_bytes(2)[1]
        assert 0 < usage.retained_bytes < chunks
        assert usage.durable_bytes + usage.retained_bytes <= limit
        assert await held(kv, 1) == 0  # its first chunk was the least recently used
        assert await held(kv, 1, tenant="bob") == TOKENS  # bob's cache is bob's
        # a spill refused anyway frees nothing for it
        with pytest.raises(QuotaExceeded):
            await spill(kv, 3)
        assert (await kv.stat(usage_of="acme")).tenant_usage.retained_bytes == \
            usage.retained_bytes


async def test_retained_chunks_survive_a_restart(tmp_path):
    data = tmp_path / "data"
    async with running_server(data) as (_, target), AsyncClient(target) as kv:
        await spill(kv, 1, ack="durable")
        await spill(kv, 2, ack="durable")
        await kv.delete("acme", "s1")
        before = await kv.stat(usage_of="acme")
    async with running_server(data) as (_, target), AsyncClient(target) as kv:
        after = await kv.stat(usage_of="acme")
        assert after.retained_chunks == before.retained_chunks == CHUNKS
        assert after.retained_bytes == before.retained_bytes == session_bytes(1)[0]
        assert after.tenant_usage.retained_bytes == before.tenant_usage.retained_bytes
        assert await held(kv, 1) == TOKENS
        # still cache: a spill naming them takes them back (sending none of them)
        result = await kv.spill("acme", "again", LAYOUT.name, tokens_for(TOKENS, seed=1),
                                streams_for(LAYOUT, TOKENS, seed=1), generation=1)
        assert (result.chunks_sent, result.chunks_deduped) == (0, CHUNKS)
        assert (await kv.stat()).retained_chunks == 0
        assert_streams_equal((await kv.restore("acme", "again")).persistent,
                             streams_for(LAYOUT, TOKENS, seed=1))
        await kv.delete("acme", "again")
        await kv.delete("acme", "s2")
    # and still evictable: a quota that has no room for them makes them give way
    quota = {"quota": {"acme": {"durable_bytes": session_bytes(3)[1]}}}
    async with running_server(data, **quota) as (_, target), AsyncClient(target) as kv:
        assert (await kv.stat()).retained_chunks == 2 * CHUNKS
        await spill(kv, 3)
        assert (await kv.stat(usage_of="acme")).tenant_usage.retained_bytes == 0
        assert await held(kv, 1) == await held(kv, 2) == 0
        await restores_exactly(kv, [3])


async def test_stat_shows_each_tenant_only_its_own_retained_bytes(tmp_path):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs) as (_, target), \
            certs.client(target, "acme") as acme, certs.client(target, "beta") as beta, \
            certs.client(target, "admin") as admin:
        await spill(acme, 1, tenant="acme")
        await spill(beta, 2, tenant="beta")
        await spill(beta, 3, tenant="beta")
        for kv, tenant, n in ((acme, "acme", 1), (beta, "beta", 2), (beta, "beta", 3)):
            await kv.delete(tenant, f"s{n}")
        mine = await acme.stat(usage_of="acme")
        assert (mine.retained_chunks, mine.retained_bytes) == (CHUNKS, session_bytes(1)[0])
        assert mine.tenant_usage.retained_bytes == session_bytes(1)[0]
        theirs = await beta.stat(usage_of="beta")
        assert theirs.retained_chunks == 2 * CHUNKS
        assert theirs.tenant_usage.retained_bytes == sum(
            session_bytes(n, "beta")[0] for n in (2, 3))
        with pytest.raises(PermissionDenied):
            await acme.stat(usage_of="beta")
        everyone = await admin.stat()
        assert everyone.retained_chunks == 3 * CHUNKS
        assert everyone.retained_bytes == mine.retained_bytes + theirs.retained_bytes
