"""Tier manager: round trips, acks, generations, dedupe, windows (real tiers only)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kvstore.format.chunk import decode_chunk
from kvstore.format.errors import (
    InvalidRequest,
    LayoutMismatch,
    SessionNotFound,
    StaleGeneration,
)
from kvstore.session.manager import MANAGER_PRESETS
from kvstore.tiers.base import MemoryMetaStore
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.object import ObjectTier
from tests.support.manager import TINY, make_session, random_tokens, tier_keys

MB = 1 << 20


def same_bytes(got, want) -> bool:
    return bytes(got) == bytes(want)


async def test_round_trip_host_only_is_byte_identical(managers):
    manager = await managers.open([HostTier(MB)], MemoryMetaStore())
    args = make_session(random_tokens(16 * 5 + 9, seed=1), tenant="t1")
    manifest = await manager.spill("t1", "s1", generation=1, **args)
    assert manifest.num_tokens == 89 and len(manifest.chunk_keys) == 5
    result = await manager.restore("t1", "s1")
    assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in args["chunks"]]
    assert result.chunk_tiers == ["host"] * 5
    assert same_bytes(result.window, args["window"]) and result.window_tier == "host"
    assert not result.replay_needed
    assert result.manifest.tail == args["tail"]
    np.testing.assert_array_equal(result.manifest.token_ids, args["token_ids"])
    await managers.close(manager)


async def test_round_trip_hbm_host_object_and_layer_by_layer(tmp_path, managers):
    tiers = [HBMTier(4096), HostTier(8192), ObjectTier(tmp_path / "obj", 64 * MB)]
    manager = await managers.open(tiers, MemoryMetaStore())
    args = make_session(random_tokens(16 * 40 + 3, seed=2))
    await manager.spill("t", "s", generation=0, **args)
    await manager.drain()
    result = await manager.restore("t", "s")
    assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in args["chunks"]]
    # 40 chunks of ~400 B do not fit in hbm + host: some came from lower tiers.
    assert {"hbm", "host"} & set(result.chunk_tiers) and "object" in result.chunk_tiers
    stats = await manager.stat()
    assert stats.counters["evictions"] and stats.counters["demotions"]

    async with manager.reading("t", "s") as reader:
        seen = [(s.stream, s.layer) async for s in reader.layers()]
        # layer-major: layer 0 of every stream before any layer 1
        assert seen == [("lat", 0), ("idx", 0), ("lat", 1)]
        async for piece in reader.layers(streams=["lat"]):
            want = [decode_chunk(d, TINY, streams=["lat"], layers=[piece.layer])
                    .streams["lat"].codes[0] for _, d in args["chunks"]]
            tail = decode_chunk(args["tail"], TINY, streams=["lat"], layers=[piece.layer])
            want.append(tail.streams["lat"].codes[0])
            assert piece.data.codes.equal(torch.cat(want))
    await managers.close(manager)


async def test_stale_generation_refused_and_nothing_changes(managers):
    manager = await managers.open([HostTier(MB)], MemoryMetaStore())
    first = make_session(random_tokens(40, seed=3), seed=1)
    await manager.spill("t", "s", generation=5, **first)
    newer = make_session(random_tokens(50, seed=4), seed=2)
    for stale in (5, 4):
        with pytest.raises(StaleGeneration):
            await manager.spill("t", "s", generation=stale, **newer)
    result = await manager.restore("t", "s")
    assert result.manifest.generation == 5 and result.manifest.num_tokens == 40
    await manager.spill("t", "s", generation=6, **newer)
    result = await manager.restore("t", "s")
    assert result.manifest.generation == 6
    assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in newer["chunks"]]
    # the old generation's blocks are gone: only the new session's remain held
    stats = await manager.stat()
    assert stats.referenced_chunks == 3
    assert stats.tiers[0].items == 3 + 1  # three chunks and one window blob
    await managers.close(manager)


async def test_bad_spills_are_refused_whole(managers):
    manager = await managers.open([HostTier(MB)], MemoryMetaStore())
    args = make_session(random_tokens(48, seed=5))
    other = make_session(random_tokens(48, seed=6))
    bad_key = dict(args, chunks=[(other["chunks"][0][0], args["chunks"][0][1]),
                                 *args["chunks"][1:]])
    with pytest.raises(InvalidRequest, match="chain to"):
        await manager.spill("t", "s", generation=1, **bad_key)
    swapped = dict(args, chunks=[(args["chunks"][0][0], other["chunks"][0][1]),
                                 *args["chunks"][1:]])
    with pytest.raises(LayoutMismatch):
        await manager.spill("t", "s", generation=1, **swapped)
    with pytest.raises(InvalidRequest, match="chunks"):
        await manager.spill("t", "s", generation=1, **dict(args, chunks=args["chunks"][:2]))
    with pytest.raises(InvalidRequest):
        await manager.spill("t/x", "s", generation=1, **args)
    with pytest.raises(InvalidRequest, match="durable"):
        await manager.spill("t", "s", generation=1, ack="durable", **args)
    with pytest.raises(SessionNotFound):
        await manager.restore("t", "s")
    assert (await manager.stat()).tiers[0].used_bytes == 0
    await managers.close(manager)


async def test_dedupe_refcounts_shared_prefix_and_release(managers):
    tiers = [HostTier(6000)]
    manager = await managers.open(tiers, MemoryMetaStore())
    prefix = random_tokens(16 * 3, seed=7)
    # Two tenants dedupe only in a shared domain (their own domains never share chunks).
    a = make_session(np.concatenate([prefix, random_tokens(20, seed=8)]),
                     dedupe_domain="prefix")
    b = make_session(np.concatenate([prefix, random_tokens(37, seed=9)]),
                     dedupe_domain="prefix")
    await manager.spill("tenant-a", "s", generation=1, **a)
    await manager.spill("tenant-b", "s", generation=1, **b)
    shared = {k for k, _ in a["chunks"]} & {k for k, _ in b["chunks"]}
    assert len(shared) == 3
    stats = await manager.stat()
    assert stats.counters["dedupe_hits"] == 3
    assert stats.referenced_chunks == 4 + 5 - 3
    await manager.delete("tenant-a", "s")
    result = await manager.restore("tenant-b", "s")
    assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in b["chunks"]]
    held = await tier_keys(tiers[0])
    assert shared <= held and not ({k for k, _ in a["chunks"]} - shared) & held
    await manager.delete("tenant-b", "s")
    assert await tier_keys(tiers[0]) == set()
    assert tiers[0].used_bytes == 0 and (await manager.stat()).referenced_chunks == 0
    with pytest.raises(SessionNotFound):
        await manager.delete("tenant-b", "s")
    await managers.close(manager)


async def test_window_dropped_below_host_reports_replay(tmp_path, managers):
    tiers = [HostTier(MB), ObjectTier(tmp_path / "obj", 64 * MB)]
    manager = await managers.open(tiers, MemoryMetaStore())
    args = make_session(random_tokens(70, seed=10))
    await manager.spill("t", "s", generation=1, **args)
    manifest = await manager.demote("t", "s", "object")
    assert manifest.window_tier is None and manifest.window_key is None
    result = await manager.restore("t", "s")
    assert result.replay_needed and result.window is None
    assert result.chunk_tiers == ["object"] * 4
    assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in args["chunks"]]
    assert not [key for key in await tier_keys(tiers[1]) if key.startswith("win/")]
    await manager.drain()  # restore promoted the chunks back up
    assert (await manager.restore("t", "s")).chunk_tiers == ["host"] * 4
    await managers.close(manager)


async def test_window_evicted_by_pressure_updates_manifest(tmp_path, managers):
    tiers = [HostTier(2500), ObjectTier(tmp_path / "obj", 64 * MB)]
    manager = await managers.open(tiers, MemoryMetaStore())
    first = make_session(random_tokens(20, seed=11), seed=1)
    await manager.spill("t", "first", generation=1, **first)
    for i in range(4):  # newer sessions push the first one's window out of host
        await manager.spill("t", f"s{i}", generation=1,
                            **make_session(random_tokens(20, seed=20 + i), seed=2))
    await manager.drain()
    assert (await manager.get_manifest("t", "first")).window_tier is None
    result = await manager.restore("t", "first")
    assert result.replay_needed and result.window is None
    assert (await manager.stat()).counters["windows_dropped"] >= 1
    await managers.close(manager)


async def test_eviction_demotes_chunks_to_a_lower_tier_that_did_not_hold_them(managers):
    """hbm over host, neither durable (no write-back copy below): making room in hbm moves
    the older session's chunks down into host, each counted as a demotion there."""
    older = make_session(random_tokens(16 * 3, seed=12), window=False)
    newer = make_session(random_tokens(16 * 3, seed=13), window=False)
    hbm_bytes = sum(len(data) for _, data in older["chunks"])
    assert hbm_bytes == sum(len(data) for _, data in newer["chunks"])
    tiers = [HBMTier(hbm_bytes, device="cpu"), HostTier(MB)]
    manager = await managers.open(tiers, MemoryMetaStore())
    await manager.spill("t", "older", generation=1, **older)
    assert all(manager.where(key) == ["hbm"] for key, _ in older["chunks"])
    await manager.spill("t", "newer", generation=1, **newer)  # fills hbm: older moves down
    assert all(manager.where(key) == ["host"] for key, _ in older["chunks"])
    assert all(manager.where(key) == ["hbm"] for key, _ in newer["chunks"])
    counters = (await manager.stat()).counters
    assert counters["demotions"] == {"host": 3} and counters["evictions"] == {"hbm": 3}
    result = await manager.restore("t", "older", want_window=False)
    assert result.chunk_tiers == ["host"] * 3
    assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in older["chunks"]]
    await managers.close(manager)


async def test_concurrent_spills_and_restores(tmp_path, managers):
    tiers = [HostTier(40_000), ObjectTier(tmp_path / "obj", 64 * MB)]
    manager = await managers.open(tiers, MemoryMetaStore(), config=MANAGER_PRESETS["embedded"])
    prefix = random_tokens(32, seed=12)
    sessions = {
        f"s{i}": make_session(np.concatenate([prefix, random_tokens(30 + i, seed=100 + i)]))
        for i in range(12)
    }
    await asyncio.gather(*(manager.spill("t", sid, generation=1, **args)
                           for sid, args in sessions.items()))
    results = await asyncio.gather(*(manager.restore("t", sid) for sid in sessions))
    for (_, args), result in zip(sessions.items(), results, strict=True):
        assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in args["chunks"]]
    # spills of new generations racing restores: each reader sees one generation whole
    # (same tokens, same KV: the shared prefix chunks are byte-identical, as in real use)
    newer = {sid: make_session(np.concatenate([prefix, random_tokens(40, seed=200 + i)]))
             for i, sid in enumerate(sessions)}
    work = [manager.spill("t", sid, generation=2, **args) for sid, args in newer.items()]
    work += [manager.restore("t", sid) for sid in sessions]
    for result in await asyncio.gather(*work):
        if hasattr(result, "chunks"):
            want = (sessions if result.manifest.generation == 1 else newer)[
                result.manifest.session_id]
            assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in want["chunks"]]
    await asyncio.gather(*(manager.delete("t", sid) for sid in sessions))
    await manager.drain()
    assert tiers[0].used_bytes == 0 and tiers[1].used_bytes == 0
    assert (await manager.list_sessions()) == []
    await managers.close(manager)
