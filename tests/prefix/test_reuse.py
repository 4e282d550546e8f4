"""Prefix reuse over a real server: Lookup, Fork, and chunks retained after their last
session is gone."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.format.chunk import StreamData
from kvstore.format.errors import PreconditionFailed
from kvstore.format.keys import dedupe_scope
from kvtier import AsyncClient
from kvtier import codec as cc
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    streams_for,
    tokens_for,
)

C = LAYOUT.chunk_tokens


def prefix(full: dict[str, StreamData], n: int) -> dict[str, StreamData]:
    out = {}
    for s in LAYOUT.persistent_streams:
        e = s.entries_for(n)
        out[s.name] = StreamData(full[s.name].codes[:, :e], full[s.name].scales[:, :e])
    return out


async def test_fork_then_diverge_both_branches_restore_bit_exact(tmp_path):
    tokens = tokens_for(3 * C + 10)
    full = streams_for(LAYOUT, len(tokens))
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "src", LAYOUT.name, tokens, full, generation=1)
        forked = await kv.fork("acme", "src", "branch", upto_tokens=2 * C + 7)
        assert (forked.generation, forked.num_tokens, forked.chunks) == (1, 2 * C, 2)
        with pytest.raises(PreconditionFailed):
            await kv.fork("acme", "src", "branch", upto_tokens=C)
        with pytest.raises(PreconditionFailed):
            await kv.fork("acme", "src", "other", upto_tokens=len(tokens) + 1)
        got = await kv.restore("acme", "branch")
        assert len(got.token_ids) == 2 * C and got.window is None
        assert_streams_equal(got.persistent, prefix(full, 2 * C))
        # diverge: the branch goes on with other tokens and other KV past the fork
        theirs = tokens_for(3 * C + 3, seed=5)
        theirs[: 2 * C] = tokens[: 2 * C]
        other = streams_for(LAYOUT, len(theirs), seed=9)
        await kv.spill("acme", "branch", LAYOUT.name, theirs, other, generation=2)
        assert_streams_equal((await kv.restore("acme", "src")).persistent, full)
        assert_streams_equal((await kv.restore("acme", "branch")).persistent, other)
        whole = await kv.fork("acme", "src", "copy", upto_tokens=len(tokens))
        assert whole.num_tokens == len(tokens)
        assert_streams_equal((await kv.restore("acme", "copy")).persistent, full)


async def test_lookup_and_start_from_a_retained_prefix_after_the_source_is_deleted(tmp_path):
    tokens = tokens_for(3 * C + 10)
    full = streams_for(LAYOUT, len(tokens))
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "a", LAYOUT.name, tokens, full, generation=1)
        assert (await kv.delete("acme", "a")).chunks_freed == 0  # retained, not freed
        async with AsyncClient(target) as fresh:  # knows nothing of "a"
            assert await fresh.lookup("acme", LAYOUT.name, tokens) == 3 * C
            assert await fresh.lookup("acme", LAYOUT.name, tokens[: 2 * C + 1]) == 2 * C
            assert await fresh.lookup("acme", LAYOUT.name, tokens) == 3 * C
            result = await fresh.spill("acme", "b", LAYOUT.name, tokens, full, generation=1)
            assert (result.chunks_sent, result.chunks_deduped) == (0, 3)
            assert_streams_equal((await fresh.restore("acme", "b")).persistent, full)


async def test_without_retention_a_delete_frees_what_only_it_named(tmp_path):
    tokens = tokens_for(3 * C + 10)
    async with running_server(tmp_path, retain_unreferenced=False) as (_, target), \
            AsyncClient(target) as kv:
        await kv.spill("acme", "a", LAYOUT.name, tokens, streams_for(LAYOUT, len(tokens)),
                       generation=1)
        assert (await kv.delete("acme", "a")).chunks_freed == 3
        assert await kv.lookup("acme", LAYOUT.name, tokens) == 0
        assert (await kv.stat()).retained_chunks == 0


async def test_lookup_never_answers_across_tenants(tmp_path):
    tokens = tokens_for(2 * C)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "a", LAYOUT.name, tokens, streams_for(LAYOUT, len(tokens)),
                       generation=1)
        assert await kv.lookup("acme", LAYOUT.name, tokens) == 2 * C
        assert await kv.lookup("evil", LAYOUT.name, tokens) == 0
        assert await kv.lookup("acme", LAYOUT.name, tokens, model="other-weights") == 0


async def test_retained_chunks_give_way_to_new_spills_under_pressure(tmp_path):
    tokens = tokens_for(3 * C)
    full = streams_for(LAYOUT, len(tokens))
    encoded = cc.encode_session(LAYOUT, tokens, full, scope=dedupe_scope("acme"))
    size = max(len(c) for c in encoded.chunks.values())
    # room for five chunks in memory, no tier below: a second session needs the room
    # the first one's retained chunks take
    async with running_server(tmp_path, host_bytes=5 * size + size // 2, disk_bytes=0,
                              object_bytes=0) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "a", LAYOUT.name, tokens, full, generation=1)
        await kv.delete("acme", "a")
        assert await kv.lookup("acme", LAYOUT.name, tokens) == 3 * C
        theirs = tokens_for(3 * C, seed=3)
        other = streams_for(LAYOUT, len(theirs), seed=4)
        await kv.spill("acme", "b", LAYOUT.name, theirs, other, generation=1)
        assert await kv.lookup("acme", LAYOUT.name, tokens) < 3 * C
        assert await kv.lookup("acme", LAYOUT.name, theirs) == 3 * C
        assert_streams_equal((await kv.restore("acme", "b")).persistent, other)


async def test_the_cli_looks_up_and_forks(tmp_path, capsys):
    import asyncio

    from services.cli.main import main

    tokens = tokens_for(2 * C + 1)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "a", LAYOUT.name, tokens, streams_for(LAYOUT, len(tokens)),
                       generation=1)
        ids = ",".join(str(int(t)) for t in tokens)
        assert await asyncio.to_thread(main, ["lookup", "--server", target, "--tenant",
                                              "acme", ids]) == 0
        assert f"{2 * C} of {len(tokens)} tokens held" in capsys.readouterr().out
        assert await asyncio.to_thread(main, ["fork", "--server", target, "--tenant", "acme",
                                              "--upto-tokens", str(C), "a", "b"]) == 0
        assert "generation 1" in capsys.readouterr().out
        assert (await kv.stat("acme", "b")).session.num_tokens == C


async def test_an_offline_compaction_keeps_the_chunks_the_server_retains(tmp_path):
    from services import cli

    tokens = tokens_for(3 * C + 10)
    full = streams_for(LAYOUT, len(tokens))
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "a", LAYOUT.name, tokens, full, generation=1, ack="durable")
        await kv.delete("acme", "a")  # its chunks stay, retained
    compact = ["compact", "--data-dir", str(tmp_path)]
    assert await asyncio.to_thread(cli.main, compact) == 0
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        assert await kv.lookup("acme", LAYOUT.name, tokens) == 3 * C
    # a server configured without retention has them collected
    config = tmp_path / "no-retention.toml"
    config.write_text("retain_unreferenced = false\n")
    assert await asyncio.to_thread(cli.main, [*compact, "--config", str(config)]) == 0
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        assert await kv.lookup("acme", LAYOUT.name, tokens) == 0
