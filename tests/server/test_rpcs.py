"""Every RPC over a real loopback server with real disk and object tiers in a tmp dir."""

from __future__ import annotations

import pytest

from kvstore.format.errors import InvalidRequest, SessionNotFound
from kvstore.format.hints import ResumeHint
from kvtier import AsyncClient
from kvtier.errors import PreconditionFailed
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    streams_for,
    tokens_for,
    window_for,
)

TOKENS = 2 * LAYOUT.chunk_tokens + 102  # two chunks, a tail, 2 pending rows


async def test_spill_restore_resume_roundtrip(tmp_path):
    tokens = tokens_for(TOKENS)
    persistent = streams_for(LAYOUT, TOKENS)
    window = window_for(LAYOUT, TOKENS)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        result = await kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, window=window,
                                generation=1)
        assert result.generation == 1 and result.chunks_written == 2
        assert result.window_kept and result.tier == "host"
        restored = await kv.restore("acme", "s1")
        assert restored.token_ids.tolist() == tokens.tolist()
        assert_streams_equal(restored.persistent, persistent)
        assert_streams_equal(restored.window, window)
        assert restored.window_start == TOKENS - 128 and not restored.replay_needed
        resumed = await kv.resume("acme", "s1")
        assert not resumed.replayed
        assert_streams_equal(resumed.persistent, persistent)
        assert_streams_equal(resumed.window, window)


async def test_control_rpcs(tmp_path):
    tokens = tokens_for(TOKENS)
    persistent = streams_for(LAYOUT, TOKENS)
    window = window_for(LAYOUT, TOKENS)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        for i in range(3):
            result = await kv.spill("acme" if i < 2 else "other", f"s{i}", LAYOUT.name,
                                    tokens, persistent, window=window, generation=1,
                                    ack="durable", hint=ResumeHint(30.0, priority=i),
                                    ttl_s=3600)
            # s1 shares s0's chunks; another tenant ("other") never dedupes against acme.
            assert result.durable and result.chunks_deduped == (2 if i == 1 else 0)
        assert [s.session.session_id for s in await kv.list("acme")] == ["s0", "s1"]
        assert len(await kv.list(page_size=1)) == 3
        stat = await kv.stat("acme", "s0")
        assert stat.sessions == 3 and stat.session.num_tokens == TOKENS
        assert [t.name for t in stat.tiers] == ["host", "disk", "object"]
        # Identical prefixes: the second spill shared the first one's chunks.
        assert stat.session.chunks == 2

        evicted = await kv.evict("acme", "s0", "disk")
        assert evicted.tier == "disk" and evicted.window_dropped
        info = (await kv.stat("acme", "s0")).session
        assert info.tiers == ["disk"] and info.window_tier == ""
        # an evict never moves a block up: the reply says where the session is, not
        # where it was asked to go
        higher = await kv.evict("acme", "s0", "host")
        assert higher.tier == "disk" and not higher.window_dropped
        restored = await kv.restore("acme", "s0")
        assert restored.replay_needed and restored.window is None
        assert_streams_equal(restored.persistent, persistent)

        prefetched = await kv.prefetch("acme", "s0", timeout_s=10)
        assert prefetched.complete and prefetched.tier == "host"

        deleted = await kv.delete("acme", "s1")
        assert deleted.chunks_released == 2 and deleted.chunks_freed == 0  # s0 shares them
        assert (await kv.stat()).sessions == 2
        with pytest.raises(SessionNotFound):
            await kv.restore("acme", "s1")


async def test_resume_without_a_replay_worker_says_so(tmp_path):
    tokens = tokens_for(TOKENS)
    async with running_server(tmp_path, replay="off") as (_, target), \
            AsyncClient(target) as kv:
        await kv.spill("acme", "s1", LAYOUT.name, tokens, streams_for(LAYOUT, TOKENS),
                       generation=1)
        with pytest.raises(PreconditionFailed, match="replay"):
            await kv.resume("acme", "s1")


async def test_durable_ack_needs_a_durable_tier(tmp_path):
    tokens = tokens_for(TOKENS)
    async with running_server(tmp_path, disk_bytes=0, object_bytes=0) as (_, target), \
            AsyncClient(target) as kv:
        with pytest.raises(InvalidRequest, match="durable"):
            await kv.spill("acme", "s1", LAYOUT.name, tokens, streams_for(LAYOUT, TOKENS),
                           generation=1, ack="durable")
        result = await kv.spill("acme", "s1", LAYOUT.name, tokens,
                                streams_for(LAYOUT, TOKENS), generation=1)
        assert not result.durable and result.tier == "host"
