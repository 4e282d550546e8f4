"""ENOSPC and EIO injected at each write, fsync, read and file-creation call of the disk
tier (testing.faultfs): a failed write is TierFull or TierUnavailable, never
anything else; the tier takes writes again as soon as the fault clears, with no
restart; nothing acknowledged is lost; a failed read falls through or is DATA_LOSS."""

from __future__ import annotations

import errno
import random

import pytest

from kvstore.format.errors import DataLoss, TierFull, TierUnavailable
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.index import SegState
from testing.faultfs import FaultyFileSystem
from testing.power_loss import TENANT, Spill, crash_layout, session_args

SEGMENT = 8192
EXPECTED = {errno.ENOSPC: TierFull, errno.EIO: TierUnavailable}


def value(i: int) -> bytes:
    return random.Random(i).randbytes(500 + 97 * i % 2500)


async def write_through_fault(tier: DiskTier, fs: FaultyFileSystem, kind: str, code: int,
                              nth: int, count: int = 12) -> dict[str, bytes]:
    """Durable puts with the ``nth`` next call of ``kind`` failing; the acknowledged ones."""
    acked = {}
    fs.fail(kind, code, nth=nth)
    for i in range(count):
        try:
            await tier.put(f"k{i}", value(i), durable=True)
        except (TierFull, TierUnavailable) as exc:
            assert isinstance(exc, EXPECTED[code]), exc
            continue
        acked[f"k{i}"] = value(i)
    return acked


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("kind", ["write", "fsync", "dirsync", "open", "truncate"])
async def test_each_failing_call_is_a_tier_error_and_loses_nothing_acked(tmp_path, kind,
                                                                         code, opened):
    for nth in range(1, 8):
        path = tmp_path / f"{nth}"
        fs = FaultyFileSystem()
        tier = opened.adopt(DiskTier(path, 1 << 26, segment_bytes=SEGMENT, fs=fs))
        if kind == "truncate":  # a truncation only follows a failed write
            fs.fail("write", code, nth=nth)
        acked = await write_through_fault(tier, fs, kind, code, nth)
        assert len(acked) < 12 or fs.injected.get(kind, 0) == 0
        fs.heal()
        await tier.put("after", b"the fault cleared", durable=True)  # no restart
        for key, data in acked.items():
            assert bytes(await tier.get(key)) == data
        await opened.close(tier)
        tier = opened.adopt(DiskTier(path, 1 << 26, segment_bytes=SEGMENT))
        for key, data in acked.items():
            assert bytes(await tier.get(key)) == data, (kind, nth, key)
        assert bytes(await tier.get("after")) == b"the fault cleared"
        assert await tier.count() == len(acked) + 1  # a failed put left no entry
        await opened.close(tier)


async def test_a_full_disk_recovers_without_restart_and_abandons_a_torn_segment(tmp_path, opened):
    fs = FaultyFileSystem()
    tier = opened.adopt(DiskTier(tmp_path, 1 << 26, segment_bytes=SEGMENT, fs=fs))
    await tier.put("before", value(1), durable=True)
    fs.fail("write", errno.ENOSPC, times=None)
    fs.fail("truncate", errno.ENOSPC, times=None)  # the failed record cannot be cut off
    for i in range(20):
        with pytest.raises(TierFull):
            await tier.put(f"full{i}", value(i), durable=True)
    fs.heal()
    for i in range(20):  # the old main raised ValueError (closed file) here forever
        await tier.put(f"k{i}", value(i), durable=True)
    sealed = [s for s in tier.segments() if s.state == SegState.SEALED]
    assert sealed, "the segment the failed write tore was sealed, not reused"
    await opened.close(tier)
    tier = opened.adopt(DiskTier(tmp_path, 1 << 26, segment_bytes=SEGMENT))
    assert bytes(await tier.get("before")) == value(1)
    for i in range(20):
        assert bytes(await tier.get(f"k{i}")) == value(i)
        assert not await tier.contains(f"full{i}")
    await opened.close(tier)


async def test_after_a_failed_fsync_the_segment_is_never_trusted_again(tmp_path, opened):
    fs = FaultyFileSystem()
    tier = opened.adopt(DiskTier(tmp_path, 1 << 26, segment_bytes=1 << 20, fs=fs))
    await tier.put("a", value(1), durable=True)
    first = tier.index.lookup(b"a").seg_id
    fs.fail("fsync", errno.EIO)
    with pytest.raises(TierUnavailable):
        await tier.put("b", value(2), durable=True)
    await tier.put("c", value(3), durable=True)
    assert tier.index.lookup(b"c").seg_id != first  # rolled away from the failed one
    assert not await tier.contains("b")
    await opened.close(tier)


async def test_eio_on_read_is_data_loss_and_clears(tmp_path, managers):
    fs = FaultyFileSystem()
    disk = DiskTier(tmp_path, 1 << 26, segment_bytes=SEGMENT, fs=fs)
    manager = await managers.open([disk], disk.meta)
    session = session_args(crash_layout(), Spill("s", 1, 40))
    await manager.spill(TENANT, "s", generation=1, ack="durable", **session)
    fs.fail("read", errno.EIO)
    with pytest.raises(TierUnavailable):
        await disk.get(session["chunks"][0][0])
    fs.fail("read", errno.EIO, times=None)  # no chunk reads (the manifest is in memory)
    with pytest.raises(DataLoss):
        await manager.restore(TENANT, "s")
    fs.heal()
    await managers.close(manager)
    disk = DiskTier(tmp_path, 1 << 26, segment_bytes=SEGMENT, fs=fs)
    manager = await managers.open([disk], disk.meta)
    fs.fail("read", errno.EIO, times=None)
    with pytest.raises(TierUnavailable):  # nor the manifest, in a process that reads it
        await manager.restore(TENANT, "s")
    fs.heal()
    got = await manager.restore(TENANT, "s")
    assert [bytes(c) for c in got.chunks] == [c for _, c in session["chunks"]]
    await managers.close(manager)
