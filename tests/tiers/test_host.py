"""HostTier: host-RAM values with exact accounting, copy-in, read-only views out."""

from __future__ import annotations

import array

import pytest
import torch

from kvstore.format.errors import ChunkNotFound, InvalidRequest, TierFull
from kvstore.tiers.host import HostTier
from tests.support.clock import ManualClock


async def test_round_trip_and_copy_semantics():
    tier = HostTier(1 << 20)
    source = bytearray(b"abcdef" * 100)
    await tier.put("k", source)
    source[:3] = b"XYZ"  # the caller's buffer changing later must not change the stored value
    got = await tier.get("k")
    assert bytes(got) == b"abcdef" * 100
    assert got.readonly
    with pytest.raises(TypeError):
        got[0] = 0
    assert tier.used_bytes == 600
    assert await tier.contains("k")
    assert [k async for k in tier.keys()] == ["k"]  # noqa: SIM118 - async iterator
    assert (await tier.stats()).items == 1


async def test_overwrite_and_delete_adjust_accounting():
    tier = HostTier(1000)
    await tier.put("a", b"x" * 400)
    await tier.put("b", b"y" * 300)
    await tier.put("a", b"z" * 100)  # shrink
    assert tier.used_bytes == 400
    await tier.put("a", b"w" * 700)  # grow: 700 + 300 fits exactly
    assert tier.used_bytes == 1000 and tier.free_bytes == 0
    assert await tier.delete("b") == 300
    assert await tier.delete("b") == 0
    assert tier.used_bytes == 700
    assert await tier.held_bytes() == 700


async def test_put_that_does_not_fit_raises_and_keeps_old_value():
    tier = HostTier(1000)
    await tier.put("a", b"1" * 600)
    with pytest.raises(TierFull):
        await tier.put("b", b"2" * 500)
    with pytest.raises(TierFull):
        await tier.put("a", b"3" * 1001)
    assert bytes(await tier.get("a")) == b"1" * 600
    assert tier.used_bytes == 600
    assert not await tier.contains("b")


async def test_missing_key_and_bad_input():
    tier = HostTier(100)
    with pytest.raises(ChunkNotFound):
        await tier.get("nope")
    with pytest.raises(InvalidRequest):
        await tier.put("", b"x")
    with pytest.raises(InvalidRequest):
        await tier.put(7, b"x")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        await tier.put("k", "a str is not bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        await tier.put("k", b"x", ttl_s=0)
    assert tier.used_bytes == 0


async def test_empty_and_non_byte_format_buffers():
    tier = HostTier(100)
    await tier.put("empty", b"")
    assert bytes(await tier.get("empty")) == b""
    floats = array.array("f", [1.0, 2.0])
    await tier.put("floats", floats)
    assert bytes(await tier.get("floats")) == floats.tobytes()
    assert tier.used_bytes == 8


async def test_ttl_expiry_frees_accounting():
    clock = ManualClock()
    tier = HostTier(100, clock=clock)
    await tier.put("short", b"s" * 40, ttl_s=30)
    await tier.put("long", b"l" * 40)
    clock.advance(29)
    with pytest.raises(TierFull):  # short still counts, and is not yet expired
        await tier.put("new", b"n" * 60)
    assert await tier.contains("short")
    clock.advance(2)
    assert tier.used_bytes == 80  # still held until looked up or room is needed
    await tier.put("new", b"n" * 60)  # needs the expired value's room
    assert tier.used_bytes == 100
    assert not await tier.contains("short")
    with pytest.raises(ChunkNotFound):
        await tier.get("short")


async def test_put_without_ttl_clears_an_old_ttl():
    clock = ManualClock()
    tier = HostTier(100, clock=clock)
    await tier.put("k", b"1", ttl_s=30)
    await tier.put("k", b"2")
    clock.advance(3600)
    assert bytes(await tier.get("k")) == b"2"


async def test_tensors_in_and_out():
    tier = HostTier(1000)
    assert tier.holds_window
    source = torch.arange(10, dtype=torch.uint8)
    await tier.put_tensor("t", source)
    source.zero_()
    stored = await tier.get_tensor("t")
    assert stored.dtype == torch.uint8 and stored.device.type == "cpu"
    assert stored.tolist() == list(range(10))
    with pytest.raises(InvalidRequest):
        await tier.put_tensor("bad", torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(InvalidRequest):
        await tier.put_tensor("bad", torch.zeros(4, dtype=torch.float32))
    assert tier.used_bytes == 10


def test_pinning_follows_cuda_availability():
    assert HostTier(0).pin_memory == torch.cuda.is_available()
    with pytest.raises(ValueError):
        HostTier(-1)


async def test_a_value_a_reader_hashed_stays_proven_until_it_is_stored_again():
    tier = HostTier(1 << 20)
    await tier.put("k", b"abc" * 100)
    values, proven = await tier.get_many_proven(["k", "absent"])
    assert proven == [False, False] and isinstance(values[1], ChunkNotFound)
    tier.note_proven("k", bytes(values[0]))  # a copy of the bytes is no proof of the stored
    assert (await tier.get_many_proven(["k"]))[1] == [False]
    tier.note_proven("k", values[0])
    assert (await tier.get_many_proven(["k"]))[1] == [True]
    await tier.put("k", b"xyz" * 100)  # stored again: other bytes, no longer proven
    assert (await tier.get_many_proven(["k"]))[1] == [False]
    tier.note_proven("k", (await tier.get_many_proven(["k"]))[0][0])
    await tier.delete("k")
    await tier.put("k", b"abc" * 100)
    assert (await tier.get_many_proven(["k"]))[1] == [False]
