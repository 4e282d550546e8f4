"""Online space reclamation: the writer rewrites its own mostly dead segments, so a
delete under a live tier frees disk space without a restart or ``kvtier compact``."""

from __future__ import annotations

import asyncio

from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.index import SegState


def files_bytes(tier: DiskTier) -> int:
    return sum(p.stat().st_size for p in tier.segment_dir.iterdir())


async def test_deletes_free_segment_files_under_a_live_tier(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 26, segment_bytes=64 << 10,
                                 reclaim_dead_fraction=0.5, reclaim_interval_s=0))
    values = {f"k{i}": bytes([i % 251]) * 8000 for i in range(64)}
    for key, value in values.items():
        await tier.put(key, value)
    await tier.commit_with_meta({"manifest/t/s": b"names the kept keys"})
    before = files_bytes(tier)
    doomed = [key for i, key in enumerate(values) if i % 4]
    for key in doomed:
        await tier.delete(key)
    await tier.reclaimer.idle()
    assert tier.reclaimer.rounds >= 1 and tier.reclaimer.reclaimed_bytes > 0
    assert files_bytes(tier) < before / 2
    assert all(s.dead_fraction < 0.5 for s in tier.segments() if s.state == SegState.SEALED)
    named = {s.seg_id for s in tier.segments()}
    assert {int(p.stem) for p in tier.segment_dir.iterdir()} <= named  # nothing unnamed
    for key, value in values.items():
        if key not in doomed:
            assert bytes(await tier.get(key)) == value
    assert await tier.meta.get("manifest/t/s") == b"names the kept keys"
    await opened.close(tier)
    # the moved metadata record is still the live one
    tier = opened.adopt(DiskTier(tmp_path, 1 << 26))
    assert await tier.meta.get("manifest/t/s") == b"names the kept keys"
    assert tier.recovery.dropped_entries == []
    await opened.close(tier)


async def test_reclamation_off_leaves_dead_bytes(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 1 << 26, segment_bytes=64 << 10))
    for i in range(32):
        await tier.put(f"k{i}", b"x" * 8000)
    for i in range(32):
        await tier.delete(f"k{i}")
    await asyncio.sleep(0.05)
    assert tier.reclaimer.rounds == 0 and tier.dead_bytes > 0
    await opened.close(tier)
