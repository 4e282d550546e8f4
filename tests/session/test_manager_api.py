"""Tier manager calls the service relies on: spills naming held chunks by key only,
delete counts, keeping a window rebuilt by replay, and the session count."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore.format.errors import (
    ChunksNotHeld,
    InvalidRequest,
    LayoutMismatch,
    SessionNotFound,
    StaleGeneration,
)
from kvstore.tiers.base import MemoryMetaStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from tests.support.manager import make_session, random_tokens, tier_keys

MB = 1 << 20


def keys_only(args: dict, held: int) -> dict:
    """``args`` with its first ``held`` chunks named by key alone."""
    chunks = [(key, None if i < held else data) for i, (key, data) in enumerate(args["chunks"])]
    return {**args, "chunks": chunks}


async def test_spill_references_held_chunks_by_key_only(tmp_path, managers):
    host, disk = HostTier(MB), DiskTier(tmp_path / "disk", 64 * MB)
    manager = await managers.open([host, disk], disk.meta)
    tokens = random_tokens(16 * 5 + 3, seed=50)
    first = make_session(tokens[:16 * 3 + 5], seed=1)
    await manager.spill("t", "s", generation=1, **first)
    grown = make_session(tokens, seed=1)  # same seed: the prefix chunks are gen 1's bytes
    manifest = await manager.spill("t", "s", generation=2, ack="durable",
                                   **keys_only(grown, 3))
    assert manifest.chunk_sizes == tuple(len(d) for _, d in grown["chunks"])
    assert (await manager.stat()).counters["dedupe_hits"] == 3
    assert await tier_keys(disk) >= {k for k, _ in grown["chunks"]}  # durable: all on disk
    result = await manager.restore("t", "s")
    assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in grown["chunks"]]

    # Another session naming the same chunks: sizes it cannot take from its own last
    # manifest come from the held copies.
    other = await manager.spill("t", "other", generation=1, **keys_only(grown, 5))
    assert other.chunk_sizes == manifest.chunk_sizes

    # Chunks nobody holds: refused whole, naming them; nothing of the spill stays.
    before = await tier_keys(host)
    stranger = make_session(random_tokens(16 * 3, seed=51), seed=2)
    with pytest.raises(ChunksNotHeld, match="indices 0, 1") as info:
        await manager.spill("t", "new", generation=1, **keys_only(stranger, 2))
    assert info.value.indices == (0, 1)
    with pytest.raises(SessionNotFound):
        await manager.get_manifest("t", "new")
    assert await tier_keys(host) == before

    wrong = {**stranger, "chunks": [(grown["chunks"][0][0], None), *stranger["chunks"][1:]]}
    with pytest.raises(InvalidRequest, match="chain to"):
        await manager.spill("t", "new", generation=1, **wrong)
    bad_tail = {**keys_only(grown, 1), "tail": first["tail"]}  # the tail of other tokens
    with pytest.raises(InvalidRequest, match="tail"):
        await manager.spill("t", "s", generation=3, **bad_tail)
    await managers.close(manager)


async def test_delete_counts_are_exact_under_concurrency(managers):
    host = HostTier(MB)
    manager = await managers.open([host], MemoryMetaStore())
    prefix = random_tokens(16 * 3, seed=52)
    a = make_session(np.concatenate([prefix, random_tokens(20, seed=53)]))
    b = make_session(np.concatenate([prefix, random_tokens(37, seed=54)]))
    c = make_session(np.concatenate([prefix, random_tokens(16, seed=55)]))
    await manager.spill("t", "a", generation=1, **a)
    await manager.spill("t", "b", generation=1, **b)
    alone = await manager.delete("t", "b")
    assert (alone.chunks_released, alone.chunks_freed) == (5, 2)  # the prefix stays (a)
    await manager.spill("t", "b", generation=2, **b)

    # Two deletes and a spill sharing the prefix race: whatever the order, the counts
    # add up to what left the tiers, and exactly c's chunks remain.
    freed_before = manager.counters.freed_chunks
    ra, rb, _ = await asyncio.gather(manager.delete("t", "a"), manager.delete("t", "b"),
                                     manager.spill("t", "c", generation=1, **c))
    assert (ra.chunks_released, rb.chunks_released) == (4, 5)
    assert ra.chunks_freed + rb.chunks_freed == manager.counters.freed_chunks - freed_before
    left = {k for k, _ in c["chunks"]}
    assert {k for k in await tier_keys(host) if not k.startswith("win/")} == left
    all_keys = {k for s in (a, b) for k, _ in s["chunks"]}
    assert ra.chunks_freed + rb.chunks_freed in (len(all_keys - left), len(all_keys))
    await managers.close(manager)


async def test_store_window_keeps_a_rebuilt_window_for_its_generation(tmp_path, managers):
    disk = DiskTier(tmp_path / "disk", 64 * MB)
    manager = await managers.open([HostTier(MB), disk], disk.meta)
    args = make_session(random_tokens(16 * 3 + 6, seed=56))
    await manager.spill("t", "s", generation=1, **args)
    await manager.demote("t", "s", "disk")  # the window cannot live on disk: dropped
    assert (await manager.restore("t", "s")).replay_needed

    with pytest.raises(LayoutMismatch):  # a window of other tokens
        other = make_session(random_tokens(16 * 3 + 6, seed=57))
        await manager.store_window("t", "s", 1, other["window"], replayed_tokens=8)
    assert await manager.store_window("t", "s", 1, args["window"], replayed_tokens=8) == "host"
    kept = await manager.restore("t", "s")
    assert not kept.replay_needed and kept.window_tier == "host"
    assert bytes(kept.window) == bytes(args["window"])
    assert kept.manifest.generation == 1
    assert kept.manifest.chunk_keys == tuple(k for k, _ in args["chunks"])
    assert [bytes(c) for c in kept.chunks] == [bytes(d) for _, d in args["chunks"]]

    await manager.spill("t", "s", generation=2, **{**args, "window": None})
    with pytest.raises(StaleGeneration, match="generation 2, not 1"):
        await manager.store_window("t", "s", 1, args["window"], replayed_tokens=8)
    after = await manager.get_manifest("t", "s")
    assert after.generation == 2 and after.window_key is None
    assert not [k for k in await tier_keys(manager.tiers[0]) if k.startswith("win/")]
    await managers.close(manager)


async def test_session_count_follows_spills_and_deletes_and_reopens(managers):
    meta = MemoryMetaStore()
    manager = await managers.open([HostTier(MB)], meta)
    sessions = {f"s{i}": make_session(random_tokens(16 * 2 + i, seed=60 + i)) for i in range(3)}
    for sid, args in sessions.items():
        await manager.spill("t", sid, generation=1, **args)
    await manager.spill("t", "s0", generation=2, **sessions["s0"])  # a new generation
    with pytest.raises(StaleGeneration):  # (generation 1 again, same content: a retry)
        await manager.spill("t", "s1", generation=0, **sessions["s1"])
    with pytest.raises(ChunksNotHeld):
        stranger = make_session(random_tokens(16 * 2, seed=70))
        await manager.spill("t", "s9", generation=1, **keys_only(stranger, 1))
    assert manager.session_count() == 3 == (await manager.stat()).sessions
    await manager.delete("t", "s1")
    assert manager.session_count() == 2
    await manager.spill("u", "s1", generation=1, ttl_s=1.0,
                        **make_session(random_tokens(16 * 2 + 1, seed=61), tenant="u"))
    report = await manager.collect_garbage(now=1e12)
    assert report.expired_sessions == 1 and manager.session_count() == 2
    await managers.close(manager)

    reopened = await managers.open([HostTier(MB)], meta)
    assert reopened.session_count() == 2 == len(await reopened.list_sessions())
    await managers.close(reopened)
