"""Tier manager over the durable and remote tiers: disk, Redis; failures and fall-through."""

from __future__ import annotations

import pytest

from kvstore.eviction.policies import HintPolicy, LRUPolicy
from kvstore.format.errors import DataLoss, InvalidRequest
from kvstore.format.hints import ResumeHint
from kvstore.tiers.base import MemoryMetaStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.object import ObjectTier
from kvstore.tiers.redis import REDIS_PRESETS, RedisTier
from tests.support.manager import make_session, random_tokens, tier_keys

MB = 1 << 20


def chunk_bytes(args) -> list[bytes]:
    return [bytes(d) for _, d in args["chunks"]]


def corrupted(data) -> bytes:
    bad = bytearray(data)
    bad[-5] ^= 0x5A  # a payload byte: the section checksum catches it
    return bytes(bad)


async def test_host_disk_round_trip_and_write_back(tmp_path, managers):
    host, disk = HostTier(MB), DiskTier(tmp_path / "disk", 64 * MB)
    manager = await managers.open([host, disk], disk.meta)
    args = make_session(random_tokens(16 * 6 + 5, seed=1))
    await manager.spill("t", "s", generation=1, **args)
    await manager.drain()
    keys = {k for k, _ in args["chunks"]}
    assert keys <= await tier_keys(disk)  # written back
    assert not [k for k in await tier_keys(disk) if k.startswith("win/")]
    stats = await manager.stat()
    assert stats.counters["writeback_done"] == 6 and stats.writeback_depth == 0
    result = await manager.restore("t", "s")
    assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
    assert result.chunk_tiers == ["host"] * 6 and not result.replay_needed
    await manager.delete("t", "s")
    assert host.used_bytes == 0 and disk.used_bytes == 0
    await managers.close(manager)


async def test_durable_ack_survives_reopen(tmp_path, managers, opened):
    disk = opened.adopt(DiskTier(tmp_path / "disk", 64 * MB))
    manager = await managers.open([HostTier(MB), disk], disk.meta)
    args = make_session(random_tokens(16 * 4 + 2, seed=2))
    await manager.spill("t", "s", generation=3, ack="durable", **args)
    await opened.close(disk)  # the process goes away: nothing is drained, host memory is lost
    managers.abandon(manager)

    disk = DiskTier(tmp_path / "disk", 64 * MB)
    manager = await managers.open([HostTier(MB), disk], disk.meta)
    result = await manager.restore("t", "s")
    assert result.manifest.generation == 3
    assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
    assert result.chunk_tiers == ["disk"] * 4
    assert result.window is None and result.replay_needed  # the window lived in host only
    assert [m.session_id for m in await manager.list_sessions("t")] == ["s"]
    await manager.delete("t", "s")  # reference counts came back with the MetaStore
    assert disk.used_bytes == 0 and await tier_keys(disk) == set()
    await managers.close(manager)


async def test_all_tiers_round_trip_with_redis(tmp_path, redis_server, managers):
    tiers = [HBMTier(3000), HostTier(6000),
             RedisTier(redis_server, 8 * MB, REDIS_PRESETS["loopback"]),
             DiskTier(tmp_path / "disk", 64 * MB)]
    manager = await managers.open(tiers, tiers[3].meta)
    sessions = {f"s{i}": make_session(random_tokens(16 * 8 + i, seed=10 + i)) for i in range(3)}
    for sid, args in sessions.items():
        await manager.spill("t", sid, generation=1, **args)
    await manager.drain()
    used = set()
    for sid, args in sessions.items():
        result = await manager.restore("t", sid)
        assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
        used |= set(result.chunk_tiers)
    assert "redis" in used  # pressure pushed blocks down through the tiers
    await manager.drain()  # restores promote what they read: the last one is on top now
    assert "hbm" in (await manager.restore("t", "s2")).chunk_tiers
    assert (await manager.stat()).counters["demotions"].get("redis", 0) > 0
    for sid in sessions:
        await manager.delete("t", sid)
    await manager.drain()
    assert [t.used_bytes for t in tiers] == [0, 0, 0, 0]
    await managers.close(manager)


async def test_redis_outage_degrades_to_other_tiers(tmp_path, redis_server, redis_process,
                                                    managers):
    redis = RedisTier(redis_server, 8 * MB, REDIS_PRESETS["loopback"])
    tiers = [HostTier(2000), redis, DiskTier(tmp_path / "disk", 64 * MB)]
    manager = await managers.open(tiers, tiers[2].meta)
    args = make_session(random_tokens(16 * 8, seed=20))
    await manager.spill("t", "s", generation=1, **args)
    await manager.drain()
    assert await tier_keys(redis)  # some chunks were demoted into Redis
    redis_process.kill()
    result = await manager.restore("t", "s")
    assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
    assert "redis" not in result.chunk_tiers
    counters = (await manager.stat()).counters
    assert counters["fallthrough_unavailable"]["redis"] > 0
    # spills keep working during the outage, placed around Redis
    other = make_session(random_tokens(16 * 6, seed=21))
    await manager.spill("t", "other", generation=1, **other)
    assert (await manager.stat()).counters["tier_errors"]["redis"] > 0
    result = await manager.restore("t", "other")
    assert [bytes(c) for c in result.chunks] == chunk_bytes(other)
    redis_process.restart()
    await managers.close(manager)


async def test_checksum_fall_through_and_promotion_rewrites(tmp_path, managers):
    host, disk = HostTier(MB), DiskTier(tmp_path / "disk", 64 * MB)
    manager = await managers.open([host, disk], disk.meta)
    args = make_session(random_tokens(16 * 3, seed=30))
    await manager.spill("t", "s", generation=1, **args)
    await manager.drain()
    key, good = args["chunks"][1]
    await host.put(key, corrupted(good))
    result = await manager.restore("t", "s")
    assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
    assert result.chunk_tiers == ["host", "disk", "host"]
    assert (await manager.stat()).counters["fallthrough_corrupt"] == {"host": 1}
    await manager.drain()
    assert bytes(await host.get(key)) == bytes(good)  # the promotion rewrote it
    assert (await manager.restore("t", "s")).chunk_tiers == ["host"] * 3

    await host.put(key, corrupted(good))
    await disk.put(key, corrupted(good))
    with pytest.raises(DataLoss, match="chunk 1"):
        await manager.restore("t", "s")
    assert (await manager.stat()).counters["misses"] == 1
    await managers.close(manager)


def flip_in_segments(disk_dir, data) -> int:
    """Flip one payload byte of every record holding ``data`` (dead ones too); how many."""
    hits = 0
    for segment in (disk_dir / "segments").iterdir():
        raw = bytearray(segment.read_bytes())
        at = raw.find(bytes(data))
        while at >= 0:
            raw[at + len(data) - 5] ^= 0xFF
            hits += 1
            at = raw.find(bytes(data), at + 1)
        segment.write_bytes(bytes(raw))
    return hits


async def test_corrupt_disk_record_falls_through_to_the_object_copy(tmp_path, managers):
    async def open_manager():
        disk = DiskTier(tmp_path / "disk", 64 * MB)
        return disk, await managers.open([disk, ObjectTier(tmp_path / "obj", 64 * MB)],
                                         disk.meta)

    disk, manager = await open_manager()
    args = make_session(random_tokens(16 * 3, seed=32))
    await manager.spill("t", "s", generation=1, **args)
    await manager.demote("t", "s", "object")
    assert (await manager.restore("t", "s")).chunk_tiers == ["object"] * 3
    await manager.drain()  # promoted: disk and object both hold every chunk now
    key, good = args["chunks"][1]
    assert manager.where(key) == ["disk", "object"]
    await managers.close(manager)
    assert flip_in_segments(tmp_path / "disk", good)  # the disk tier's record check fails

    disk, manager = await open_manager()
    result = await manager.restore("t", "s")
    assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
    assert result.chunk_tiers == ["disk", "object", "disk"]
    assert (await manager.stat()).counters["fallthrough_corrupt"] == {"disk": 1}
    await manager.drain()
    assert bytes(await disk.get(key)) == bytes(good)  # the promotion rewrote the disk copy
    assert (await manager.restore("t", "s")).chunk_tiers == ["disk"] * 3
    await managers.close(manager)


async def test_corrupt_manifest_is_data_loss_not_a_half_session(managers):
    meta = MemoryMetaStore()
    manager = await managers.open([HostTier(MB)], meta)
    await manager.spill("t", "s", generation=1, **make_session(random_tokens(20, seed=31)))
    (key, raw), = await meta.scan("manifest/")
    await meta.commit({key: raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:]})
    assert (await manager.restore("t", "s")).manifest.num_tokens == 20  # as committed here
    await managers.close(manager)
    manager = await managers.open([HostTier(MB)], meta)  # the next process reads the record
    with pytest.raises(DataLoss, match="manifest"):
        await manager.restore("t", "s")
    await managers.close(manager)


async def test_prefetch_promotes_within_timeout(tmp_path, managers):
    tiers = [HBMTier(MB), HostTier(MB), DiskTier(tmp_path / "disk", 64 * MB)]
    manager = await managers.open(tiers, tiers[2].meta)
    args = make_session(random_tokens(16 * 5, seed=40))
    await manager.spill("t", "s", generation=1, **args)
    await manager.demote("t", "s", "disk")
    cut_short = await manager.prefetch("t", "s", timeout_s=0)
    assert not cut_short.complete and cut_short.promoted == 0
    done = await manager.prefetch("t", "s", timeout_s=30)
    assert done.complete and done.blocks == 5 and done.promoted == 5
    result = await manager.restore("t", "s", want_window=False)
    assert result.chunk_tiers == ["hbm"] * 5 and result.replay_needed
    assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
    await managers.close(manager)


@pytest.mark.parametrize("policy, survivor", [(LRUPolicy, "late"), (HintPolicy, "soon")])
async def test_hint_policy_keeps_the_session_due_back_first(tmp_path, policy, survivor, managers):
    host = HostTier(4200)  # room for two of these sessions, not three
    manager = await managers.open([host, DiskTier(tmp_path / "disk", 64 * MB)],
                                     MemoryMetaStore(), policy=policy)
    hints = {"soon": ResumeHint(expected_pause_s=5), "late": ResumeHint(expected_pause_s=3600)}
    keys = {}
    for seed, sid in enumerate(["soon", "late", "new"]):
        args = make_session(random_tokens(16 * 4, seed=50 + seed), window=False)
        keys[sid] = {k for k, _ in args["chunks"]}
        await manager.spill("t", sid, generation=1, hint=hints.get(sid), **args)
        await manager.drain()  # write-back holds chunk locks; eviction skips locked chunks
    held = await tier_keys(host)
    assert keys["new"] <= held
    assert {sid for sid in ("soon", "late") if keys[sid] <= held} == {survivor}
    await managers.close(manager)


async def test_redis_restart_loses_blocks_and_a_new_spill_does_not_dedupe_against_them(
        redis_server, redis_process, managers):
    import numpy as np

    host = HostTier(1000)  # two chunks: the rest of a session goes to Redis
    redis = RedisTier(redis_server, 8 * MB, REDIS_PRESETS["loopback"])
    manager = await managers.open([host, redis], MemoryMetaStore())
    prefix = random_tokens(16 * 4, seed=60)
    first = make_session(prefix, window=False)
    await manager.spill("t", "first", generation=1, **first)
    assert await tier_keys(redis)
    redis_process.kill()
    redis_process.restart()  # not persistent: everything it held is gone
    with pytest.raises(DataLoss):
        await manager.restore("t", "first")
    second = make_session(np.concatenate([prefix, random_tokens(20, seed=61)]), window=False)
    await manager.spill("t", "second", generation=1, **second)
    result = await manager.restore("t", "second")
    assert [bytes(c) for c in result.chunks] == chunk_bytes(second)
    await managers.close(manager)


async def test_round_trip_through_redis_cluster(tmp_path, redis_cluster, managers):
    tiers = [HostTier(2000), RedisTier(redis_cluster, 8 * MB, REDIS_PRESETS["loopback"]),
             DiskTier(tmp_path / "disk", 64 * MB)]
    manager = await managers.open(tiers, tiers[2].meta)
    args = make_session(random_tokens(16 * 10, seed=70))
    await manager.spill("t", "s", generation=1, **args)
    await manager.drain()
    result = await manager.restore("t", "s")
    assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
    assert "redis" in result.chunk_tiers
    await manager.delete("t", "s")
    assert [t.used_bytes for t in tiers] == [0, 0, 0]
    await managers.close(manager)


async def test_where_and_read_chunk_report_placement_without_moving_anything(tmp_path, managers):
    host, disk = HostTier(MB), DiskTier(tmp_path / "disk", 64 * MB)
    manager = await managers.open([host, disk], disk.meta)
    args = make_session(random_tokens(16 * 2, seed=80))
    manifest = await manager.spill("t", "s", generation=1, **args)
    await manager.drain()
    key, good = args["chunks"][1]
    assert manager.where(key) == ["host", "disk"]
    await host.put(key, corrupted(good))
    data, tier = await manager.read_chunk(manifest, 1)
    assert bytes(data) == bytes(good) and tier == "disk"
    await manager.drain()
    assert bytes(await host.get(key)) != bytes(good)  # an internal read promotes nothing
    with pytest.raises(InvalidRequest):
        await manager.read_chunk(manifest, 2)
    await managers.close(manager)


async def test_a_restore_of_many_batches_reads_in_order_and_promotes_after(tmp_path, managers):
    """More chunks than one read batch: restore() and a streamed read give every chunk in
    order, bit-exact, from the disk tier; the promotions to host come once the reader is
    done, and a chunk missing from every tier is DataLoss naming its index."""
    from kvstore.session.restore import READ_BATCH

    host, disk = HostTier(64 * MB), DiskTier(tmp_path / "disk", 64 * MB)
    manager = await managers.open([host, disk], disk.meta)
    n = 2 * READ_BATCH + 5
    args = make_session(random_tokens(16 * n, seed=33))
    await manager.spill("t", "s", generation=1, ack="durable", **args)
    await manager.drain()
    await manager.demote("t", "s", "disk")
    result = await manager.restore("t", "s")
    assert [bytes(c) for c in result.chunks] == chunk_bytes(args)
    assert result.chunk_tiers == ["disk"] * n
    await manager.drain()
    assert all(manager.where(key)[0] == "host" for key, _ in args["chunks"])
    await manager.demote("t", "s", "disk")
    async with manager.reading("t", "s") as reader:
        got = [(c.index, bytes(c.data)) async for c in reader.chunks(lookahead=1)]
    assert got == list(enumerate(chunk_bytes(args)))
    await manager.drain()
    lost = args["chunks"][READ_BATCH + 1][0]
    for tier in (host, disk):  # behind the manager's back: it still believes them
        await tier.delete(lost)
    with pytest.raises(DataLoss, match=f"chunk {READ_BATCH + 1}:"):
        await manager.restore("t", "s")
    await managers.close(manager)


async def test_a_corrupt_disk_chunk_mid_batch_is_data_loss_for_it_and_nothing_after(
        tmp_path, managers, monkeypatch):
    """A disk-only session read in one batch of many pieces over several segment files,
    its chunk 5 damaged on disk and nowhere else: a streamed read in batches of 4 (the
    next batches read while one is yielded) yields chunks 0-3 bit-exact, then DataLoss
    naming chunk 5 before any chunk of its batch; a whole restore (one batch) is the
    same DataLoss."""
    from kvstore.tiers.disk import batch
    monkeypatch.setattr(batch, "PIECE_BYTES", 1)  # a piece per record
    disk = DiskTier(tmp_path / "disk", 64 * MB, segment_bytes=4096)
    manager = await managers.open([HostTier(MB), disk], disk.meta)
    args = make_session(random_tokens(16 * 12, seed=41))
    await manager.spill("t", "s", generation=1, ack="durable", **args)
    await manager.demote("t", "s", "disk")
    assert len(disk.segments()) > 2
    await managers.close(manager)
    assert flip_in_segments(tmp_path / "disk", args["chunks"][5][1])

    disk = DiskTier(tmp_path / "disk", 64 * MB, segment_bytes=4096)
    manager = await managers.open([HostTier(MB), disk], disk.meta)
    got = []
    with pytest.raises(DataLoss, match="chunk 5"):
        async with manager.reading("t", "s") as reader:
            async for chunk in reader.chunks(lookahead=12, batch=4):
                got.append(bytes(chunk.data))
    assert got == chunk_bytes(args)[:4]
    with pytest.raises(DataLoss, match="chunk 5"):
        await manager.restore("t", "s")
    await managers.close(manager)
