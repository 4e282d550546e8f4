"""Disk tier: the Tier contract, exact accounting, sealing, TTL, meta store, pinning and
compaction primitives, on real segment files and a real LMDB index in tmp_path."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from kvstore.format.errors import (
    Busy,
    ChunkCorrupt,
    ChunkNotFound,
    InvalidRequest,
    TierFull,
    TierUnavailable,
)
from kvstore.tiers.disk import DiskTier, batch
from kvstore.tiers.disk.index import SegState
from kvstore.tiers.disk.segments import HEADER_SIZE, segment_path
from tests.support.clock import ManualClock


def value_for(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def check_accounting(tier: DiskTier, model: dict[str, bytes]) -> None:
    segments = tier.segments()
    assert tier.used_bytes == sum(len(v) for v in model.values())
    assert sum(s.live_value_bytes for s in segments) == tier.used_bytes
    logged = tier.index.meta_records()  # the records logging metadata are live too
    assert sum(s.live_records for s in segments) == len(model) + len(logged)
    assert sum(s.live_bytes for s in segments) == sum(
        HEADER_SIZE + len(k.encode()) + len(v) for k, v in model.items()) + sum(
        HEADER_SIZE + len(k) + e.value_len for k, e in logged)
    for info in segments:
        assert 0 <= info.live_bytes <= info.file_bytes
        assert info.dead_bytes == info.file_bytes - info.live_bytes
        assert segment_path(tier.segment_dir, info.seg_id).stat().st_size == info.file_bytes


async def test_put_get_overwrite_delete(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 20, segment_bytes=4096))
    await tier.put("a", b"first")
    held = await tier.get("a")
    assert bytes(held) == b"first"
    with pytest.raises(TypeError):
        held[0] = 0  # values are read-only views
    await tier.put("a", b"second value")
    assert bytes(await tier.get("a")) == b"second value"
    assert tier.used_bytes == len(b"second value")
    assert tier.dead_bytes == HEADER_SIZE + 1 + len(b"first")
    await tier.put("b", memoryview(bytearray(b"xyz")))
    assert sorted([k async for k in tier.keys()]) == ["a", "b"]  # noqa: SIM118 - async iterator
    assert await tier.count() == 2
    assert await tier.delete("a") == len(b"second value")
    assert await tier.delete("a") == 0
    assert not await tier.contains("a") and await tier.contains("b")
    with pytest.raises(ChunkNotFound):
        await tier.get("a")
    assert tier.used_bytes == 3
    with pytest.raises(InvalidRequest):
        await tier.put("", b"x")
    with pytest.raises(InvalidRequest):
        await tier.put("k" * 600, b"x")
    with pytest.raises(InvalidRequest):
        await tier.put("c", "not bytes")  # type: ignore[arg-type]
    await opened.close(tier)
    with pytest.raises(TierUnavailable):
        await tier.put("c", b"x")


async def test_reopen_keeps_values_accounting_and_meta(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 24, segment_bytes=64 << 10))
    model = {f"k{i}": value_for(f"k{i}", 3000 + i) for i in range(60)}
    await asyncio.gather(*(tier.put(k, v) for k, v in model.items()))
    await tier.delete("k3")
    del model["k3"]
    await tier.meta.commit({"session/1": b"manifest-1", "session/2": b"manifest-2"})
    before = [(s.seg_id, s.state, s.file_bytes, s.live_bytes) for s in tier.segments()]
    await opened.close(tier)

    tier = opened.adopt(DiskTier(tmp_path, 1 << 24, segment_bytes=64 << 10))
    assert tier.recovery.uncommitted_records == 0 and tier.recovery.torn_bytes == 0
    assert [(s.seg_id, s.state, s.file_bytes, s.live_bytes) for s in tier.segments()] == before
    for key, value in model.items():
        assert bytes(await tier.get(key)) == value
    check_accounting(tier, model)
    assert await tier.meta.get("session/2") == b"manifest-2"
    await tier.put("after", b"reopen appends")
    assert bytes(await tier.get("after")) == b"reopen appends"
    await opened.close(tier)


async def test_second_writer_is_refused(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 20))
    assert DiskTier.writer_is_live(tmp_path)
    with pytest.raises(Busy, match="writer lock"):
        DiskTier(tmp_path, 1 << 20)
    with pytest.raises(Busy, match="already open in this process"):
        DiskTier(tmp_path, 0, writer=False)  # LMDB must not be opened twice in a process
    await opened.close(tier)
    assert not DiskTier.writer_is_live(tmp_path)


async def test_buffered_puts_are_visible_at_once_and_durable_after_flush(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 20, durable=False, commit_interval_s=60))
    await tier.put("k", b"buffered")
    assert bytes(await tier.get("k")) == b"buffered"
    assert tier.index.lookup(b"k") is None  # not yet committed
    assert tier.used_bytes == 8 and await tier.count() == 1
    await tier.delete("k")
    await tier.put("k2", b"v2")
    await tier.flush()
    assert tier.index.lookup(b"k") is None and tier.index.lookup(b"k2") is not None
    assert tier.index.totals() == (2, 1)
    await tier.put("k3", b"durable", durable=True)
    assert tier.index.lookup(b"k3") is not None
    await opened.close(tier)


async def test_segments_seal_at_the_size_limit(tmp_path, opened):
    limit = 10_000
    tier = opened.adopt(DiskTier(tmp_path, 1 << 24, segment_bytes=limit))
    for i in range(40):
        await tier.put(f"k{i:02d}", value_for(str(i), 1500), durable=False)
    await tier.put("huge", value_for("huge", 3 * limit))  # larger than a segment
    segments = tier.segments()
    sealed = [s for s in segments if s.state == SegState.SEALED]
    active = [s for s in segments if s.state == SegState.ACTIVE]
    assert len(active) == 1 and active[0].seg_id == max(s.seg_id for s in segments)
    assert len(sealed) >= 6
    for info in sealed:
        if info.live_records > 1:
            assert info.file_bytes <= limit
    assert any(s.live_records == 1 and s.file_bytes > limit for s in segments)
    assert bytes(await tier.get("huge")) == value_for("huge", 3 * limit)
    await opened.close(tier)


async def test_tier_full_stores_nothing(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1000))
    await tier.put("a", bytes(600))
    with pytest.raises(TierFull):
        await tier.put("b", bytes(500))
    with pytest.raises(TierFull):
        await tier.put_many([("c", bytes(100)), ("d", bytes(400))], meta={"m": b"1"})
    assert not await tier.contains("b") and not await tier.contains("c")
    assert await tier.meta.get("m") is None
    await tier.put("a", bytes(900))  # overwriting counts the old value as freed
    assert tier.used_bytes == 900
    await opened.close(tier)


async def test_random_operations_keep_exact_accounting(tmp_path, opened):
    rng = random.Random(1234)
    model: dict[str, bytes] = {}
    tier = opened.adopt(DiskTier(tmp_path, 1 << 26, segment_bytes=32 << 10,
                                 commit_interval_s=0.001))
    keys = [f"key-{i}" for i in range(150)]
    for step in range(2000):
        key = rng.choice(keys)
        roll = rng.random()
        if roll < 0.55:
            value = rng.randbytes(rng.randint(0, 2000))
            await tier.put(key, value, durable=rng.random() < 0.1)
            model[key] = value
        elif roll < 0.8:
            assert await tier.delete(key, durable=rng.random() < 0.1) == len(
                model.pop(key, b""))
        elif roll < 0.99:
            if key in model:
                assert bytes(await tier.get(key)) == model[key]
            else:
                assert not await tier.contains(key)
        elif step % 3 == 0:
            await opened.close(tier)
            tier = opened.adopt(DiskTier(tmp_path, 1 << 26, segment_bytes=32 << 10))
        else:
            await tier.flush()
        assert tier.used_bytes == sum(len(v) for v in model.values())
    await tier.flush()
    check_accounting(tier, model)
    assert sorted([k async for k in tier.keys()]) == sorted(model)  # noqa: SIM118 - async iterator
    await opened.close(tier)
    tier = opened.adopt(DiskTier(tmp_path, 1 << 26, segment_bytes=32 << 10))
    assert tier.recovery.dropped_entries == []
    check_accounting(tier, model)
    await opened.close(tier)


async def test_ttl_expiry_and_purge(tmp_path, opened):
    clock = ManualClock()
    tier = opened.adopt(DiskTier(tmp_path, 1 << 20, clock=clock))
    await tier.put("short", b"12345", ttl_s=0.3)
    await tier.put("long", b"678", ttl_s=3600)
    await tier.put("forever", b"9")
    clock.advance(0.29)
    assert await tier.contains("short")
    assert sorted([k async for k in tier.keys()]) == ["forever", "long", "short"]  # noqa: SIM118 - async iterator
    clock.advance(0.02)  # just past its TTL: gone
    assert not await tier.contains("short")
    with pytest.raises(ChunkNotFound, match="expired"):
        await tier.get("short")
    assert sorted([k async for k in tier.keys()]) == ["forever", "long"]  # noqa: SIM118 - async iterator
    assert await tier.purge_expired() == 0  # the get already purged it
    await tier.flush()
    assert tier.used_bytes == 4 and await tier.count() == 2
    clock.advance(3600)  # long runs out; expired entries count until purged
    assert sorted([k async for k in tier.keys()]) == ["forever"]  # noqa: SIM118 - async iterator
    assert await tier.count() == 2
    assert await tier.purge_expired() == 1
    assert tier.used_bytes == 1 and await tier.count() == 1
    with pytest.raises(InvalidRequest):
        await tier.put("bad", b"x", ttl_s=0)
    await opened.close(tier)


async def test_meta_store_commits_atomically_and_in_order(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 20, durable=False, commit_interval_s=60))
    meta = tier.meta
    await meta.commit({"s/b": b"2", "s/a": b"1", "t/x": b"other"})
    assert await meta.scan("s/") == [("s/a", b"1"), ("s/b", b"2")]
    with pytest.raises(InvalidRequest):
        await meta.commit({"s/c": b"3", "s/" + "x" * 600: b"too long key"})
    assert await meta.get("s/c") is None  # nothing of the bad batch applied
    await meta.commit({"s/a": None, "s/c": b"3"})
    assert await meta.scan("s/") == [("s/b", b"2"), ("s/c", b"3")]

    await tier.put("chunk-1", b"c1")  # buffered: not yet in the index
    assert tier.index.lookup(b"chunk-1") is None
    await tier.commit_with_meta({"manifest": b"chunk-1"})
    assert tier.index.lookup(b"chunk-1") is not None  # committed no later than the manifest

    await tier.put_many([("chunk-2", b"c2"), ("chunk-3", b"c3")],
                        meta={"manifest": b"chunk-2,chunk-3"}, durable=True)
    assert tier.index.lookup(b"chunk-3") is not None
    await opened.close(tier)
    tier = opened.adopt(DiskTier(tmp_path, 1 << 20))
    assert await tier.meta.get("manifest") == b"chunk-2,chunk-3"
    assert bytes(await tier.get("chunk-2")) == b"c2"
    await opened.close(tier)


async def fill_sealed(tier: DiskTier, count: int, size: int) -> dict[str, bytes]:
    model = {f"c{i:03d}": value_for(f"c{i}", size) for i in range(count)}
    for key, value in model.items():
        await tier.put(key, value, durable=False)
    await tier.flush()
    return model


async def test_pinning_defers_retirement(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 24, segment_bytes=8000))
    model = await fill_sealed(tier, 12, 3000)
    first = tier.segments()[0]
    assert first.state == SegState.SEALED
    victims = [k for k, _ in tier.live_entries(first.seg_id)]
    with pytest.raises(InvalidRequest, match="live records"):
        await tier.retire_segment(first.seg_id)
    active = [s for s in tier.segments() if s.state == SegState.ACTIVE][0]
    with pytest.raises(InvalidRequest, match="ACTIVE"):
        await tier.retire_segment(active.seg_id)
    tier.files.pin(first.seg_id)
    for key in victims:
        await tier.delete(key)
        del model[key]
    path = segment_path(tier.segment_dir, first.seg_id)
    assert await tier.retire_segment(first.seg_id) is False
    assert path.exists() and tier.index.segment(first.seg_id) is None
    tier.files.unpin(first.seg_id)
    assert not path.exists()
    for key, value in model.items():
        assert bytes(await tier.get(key)) == value
    await opened.close(tier)


async def test_rewrite_segments_reclaims_dead_bytes(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 24, segment_bytes=16000))
    model = await fill_sealed(tier, 40, 2000)
    for key in list(model)[::2]:
        await tier.delete(key)
        del model[key]
    sealed = [s.seg_id for s in tier.segments() if s.state == SegState.SEALED]
    dead_before, used_before = tier.dead_bytes, tier.used_bytes
    live_before = sum(len(tier.live_entries(s)) for s in sealed)
    reads = [asyncio.create_task(tier.get(k)) for k in model]  # readers in flight
    result = await tier.rewrite_segments(sealed)
    assert [bytes(v) for v in await asyncio.gather(*reads)] == list(model.values())
    assert result.retired + result.deferred == sealed
    assert result.moved == live_before > 0 and result.skipped == 0
    assert result.reclaimed_bytes > 0 and tier.dead_bytes < dead_before
    assert tier.used_bytes == used_before
    assert all(not segment_path(tier.segment_dir, s).exists() for s in result.retired)
    for key, value in model.items():
        assert bytes(await tier.get(key)) == value
    check_accounting(tier, model)
    with pytest.raises(InvalidRequest, match="SEALED"):
        await tier.rewrite_segments([sealed[0]])
    await opened.close(tier)
    tier = opened.adopt(DiskTier(tmp_path, 1 << 24, segment_bytes=16000))
    check_accounting(tier, model)
    await opened.close(tier)


async def test_switch_is_compare_and_swap_and_compactions_exclude_each_other(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 24, segment_bytes=8000))
    await fill_sealed(tier, 10, 3000)
    sealed = [s.seg_id for s in tier.segments() if s.state == SegState.SEALED]
    stale = tier.index.lookup(b"c000")
    await tier.put("c000", b"newer")  # a writer wins over a compaction's move
    outcome = tier.index.switch([(b"c000", stale, stale._replace(offset=0))], {}, [])
    assert (outcome.moved, outcome.skipped) == (0, 1)
    assert bytes(await tier.get("c000")) == b"newer"
    from kvstore.tiers.disk.lock import COMPACT_LOCK, DirLock

    elsewhere = DirLock(tmp_path / COMPACT_LOCK, "the compaction lock")
    elsewhere.acquire()  # as another process would
    with pytest.raises(Busy, match="compaction"):
        await tier.rewrite_segments(sealed)
    elsewhere.release()
    expected = sum(len(tier.live_entries(seg_id)) for seg_id in sealed)
    assert (await tier.rewrite_segments(sealed)).moved == expected == 7
    await opened.close(tier)


async def test_concurrent_writers_and_readers_match_a_model(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 26, segment_bytes=32 << 10,
                                 commit_interval_s=0.001))
    models: list[dict[str, bytes]] = [{} for _ in range(8)]

    async def worker(n: int) -> None:
        rng, model = random.Random(n), models[n]
        for _ in range(150):
            key = f"w{n}-{rng.randrange(20)}"
            if rng.random() < 0.6:
                model[key] = rng.randbytes(rng.randint(1, 3000))
                await tier.put(key, model[key], durable=rng.random() < 0.2)
            elif rng.random() < 0.5:
                assert await tier.delete(key) == len(model.pop(key, b""))
            elif key in model:
                assert bytes(await tier.get(key)) == model[key]

    await asyncio.gather(*(worker(n) for n in range(8)))
    merged = {k: v for model in models for k, v in model.items()}
    await tier.flush()
    check_accounting(tier, merged)
    await opened.close(tier)


async def test_buffered_puts_commit_in_the_background(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 20, durable=False, commit_interval_s=0.01))
    await tier.put("k", b"v")
    for _ in range(100):
        if tier.index.lookup(b"k") is not None:
            break
        await asyncio.sleep(0.01)
    assert tier.index.lookup(b"k") is not None and not tier.pipeline.overlay
    await opened.close(tier)


async def test_a_failed_commit_loses_its_batch_and_nothing_else(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 24, durable=False, commit_interval_s=60,
                                 map_size=1 << 20))
    await tier.put("kept", b"committed", durable=True)
    await tier.put("lost", b"buffered in the failing batch")
    with pytest.raises(TierFull, match="LMDB"):
        # a derived record lives in the index itself (a logged one in its record)
        await tier.commit_with_meta({"ref/huge": bytes(2 << 20)})  # larger than the map
    assert not await tier.contains("lost") and await tier.meta.get("ref/huge") is None
    with pytest.raises(TierFull):
        await tier.flush()  # reports the buffered write it lost, once
    await tier.flush()
    await tier.put("after", b"still works", durable=True)
    assert tier.used_bytes == len(b"committed") + len(b"still works")
    await opened.close(tier)
    tier = opened.adopt(DiskTier(tmp_path, 1 << 24, map_size=1 << 20))
    assert sorted([k async for k in tier.keys()]) == ["after", "kept"]  # noqa: SIM118
    assert tier.used_bytes == len(b"committed") + len(b"still works")
    await opened.close(tier)


async def test_get_many_reads_in_one_batch_and_answers_each_key(tmp_path, opened):
    """get_many: every value bit-exact and in the order asked, across segments and with
    a buffered put; a missing key answers ChunkNotFound and a record whose
    bytes were damaged on the file ChunkCorrupt, while the other keys are still served."""
    tier = opened.adopt(DiskTier(tmp_path, 1 << 22, segment_bytes=8192))
    model = {f"k{i:03d}": value_for(f"k{i:03d}", 700 + 37 * i) for i in range(40)}
    await tier.put_many(model.items())
    await tier.put("late", b"buffered", durable=False)
    model["late"] = b"buffered"
    assert len(tier.segments()) > 3
    keys = list(model)[::-1] + ["absent"]
    got = await tier.get_many(keys)
    assert [bytes(v) for v in got[:-1]] == [model[k] for k in keys[:-1]]
    assert isinstance(got[-1], ChunkNotFound)
    entry = tier.index.lookup(b"k007")
    with open(segment_path(tier.segment_dir, entry.seg_id), "r+b") as file:
        file.seek(entry.offset + HEADER_SIZE + len(b"k007") + 5)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0x40]))
    got = await tier.get_many(["k006", "k007", "k008"])
    assert bytes(got[0]) == model["k006"] and bytes(got[2]) == model["k008"]
    assert isinstance(got[1], ChunkCorrupt)
    await opened.close(tier)


@pytest.mark.parametrize("at", [0, 5, 12, 14, 16, HEADER_SIZE + 1, -1])
async def test_a_batch_refuses_a_record_damaged_anywhere_and_serves_the_others(
        tmp_path, opened, at):
    """The batch's record check (headers in one array) refuses a flipped byte of the
    magic, checksum, lengths, flags, key or value, as check_record does."""
    tier = opened.adopt(DiskTier(tmp_path, 1 << 22))
    model = {f"k{i:03d}": value_for(f"k{i:03d}", 900) for i in range(6)}
    await tier.put_many(model.items())
    entry = tier.index.lookup(b"k002")
    size = HEADER_SIZE + len(b"k002") + entry.value_len
    with open(segment_path(tier.segment_dir, entry.seg_id), "r+b") as file:
        file.seek(entry.offset + at % size)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0x01]))
    got = await tier.get_many(list(model))
    assert isinstance(got[2], ChunkCorrupt)
    assert [bytes(v) for i, v in enumerate(got) if i != 2] == \
        [v for k, v in model.items() if k != "k002"]
    await opened.close(tier)


async def test_a_batch_of_many_pieces_over_several_segments_is_exact_and_a_short_piece_is_refused(
        tmp_path, opened, monkeypatch):
    """A batch read as many pieces (one piece per few records) over several segment files:
    every value bit-exact in the order asked. With the last segment file cut short, the
    keys whose records it lost answer an error (never bytes), the others their values."""
    monkeypatch.setattr(batch, "PIECE_BYTES", 2000)
    tier = opened.adopt(DiskTier(tmp_path, 1 << 22, segment_bytes=8192))
    model = {f"k{i:03d}": value_for(f"k{i:03d}", 700 + 37 * i) for i in range(40)}
    await tier.put_many(model.items())
    assert len(tier.segments()) > 3
    keys = list(model)
    got = await tier.get_many(keys)
    assert [bytes(v) for v in got] == [model[k] for k in keys]

    last = max(tier.index.lookup(k.encode()).seg_id for k in keys)
    in_last = [k for k in keys if tier.index.lookup(k.encode()).seg_id == last]
    cut = min(tier.index.lookup(k.encode()).offset for k in in_last) + HEADER_SIZE + 10
    with open(segment_path(tier.segment_dir, last), "r+b") as file:
        file.truncate(cut)
    got = await tier.get_many(keys)
    for key, value in zip(keys, got, strict=True):
        if key in in_last:
            assert isinstance(value, (ChunkCorrupt, TierUnavailable)), key
        else:
            assert bytes(value) == model[key], key
    await opened.close(tier)


async def test_a_delete_and_compaction_racing_a_batched_read_never_give_wrong_bytes(
        tmp_path, opened, monkeypatch):
    """Keys deleted, their segment compacted away and its space rewritten while a batch
    is between its index lookup and its reads: the batch answers the bytes it looked up
    (the pinned segment stays readable), and the next batch says they are gone."""
    tier = opened.adopt(DiskTier(tmp_path, 1 << 22, segment_bytes=16384))
    model = {f"k{i:03d}": value_for(f"k{i:03d}", 900) for i in range(12)}
    await tier.put_many(model.items())
    seg_ids = sorted({tier.index.lookup(k.encode()).seg_id for k in model})
    looked_up, release = asyncio.Event(), threading.Event()
    read_pieces = batch._read_pieces

    def held_read(*args):
        loop.call_soon_threadsafe(looked_up.set)
        assert release.wait(10)
        return read_pieces(*args)

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(batch, "_read_pieces", held_read)
    reading = asyncio.ensure_future(tier.get_many(list(model)))
    await looked_up.wait()
    for key in model:
        await tier.delete(key, durable=True)
    await tier.put_many((f"new{i}", value_for(f"new{i}", 900)) for i in range(12))
    await tier.rewrite_segments(seg_ids)
    for seg_id in seg_ids:
        await tier.retire_segment(seg_id)
    release.set()
    got = await reading
    assert [bytes(v) for v in got] == list(model.values())
    monkeypatch.setattr(batch, "_read_pieces", read_pieces)
    assert all(isinstance(v, ChunkNotFound) for v in await tier.get_many(list(model)))
    await opened.close(tier)
