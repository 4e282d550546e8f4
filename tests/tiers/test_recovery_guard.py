"""Recovery on open never removes a segment file that index entries still name: its own
segment record was lost to damage, so the open refuses (naming the repair) instead."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.compaction.index_repair import repair
from kvstore.format.errors import IndexCorrupt
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.index import _SEG_KEY
from kvstore.tiers.disk.segments import segment_path


async def _filled(path):
    tier = DiskTier(path, 1 << 24, segment_bytes=4096)
    values = {f"k{i}": bytes([i]) * 1500 for i in range(12)}
    try:
        for key, value in values.items():
            await tier.put(key, value)
    finally:
        await tier.close()
    return values


def test_a_segment_whose_record_was_lost_is_kept_and_the_open_names_the_repair(tmp_path):
    path = tmp_path / "disk"
    values = asyncio.run(_filled(path))
    tier = DiskTier(path, 1 << 24)
    try:
        seg_id = tier.index.lookup(b"k0").seg_id
        with tier.index.write() as txn:  # the damage: segment 1's own record is gone
            txn.delete(_SEG_KEY.pack(seg_id), db=tier.index.segments)
    finally:
        asyncio.run(tier.close())
    with pytest.raises(IndexCorrupt, match="kvtier repair"):
        DiskTier(path, 1 << 24)
    assert segment_path(path / "segments", seg_id).exists()  # nothing was removed
    repair(path)
    tier = DiskTier(path, 1 << 24)
    try:
        for key, value in values.items():
            assert bytes(asyncio.run(tier.get(key))) == value
    finally:
        asyncio.run(tier.close())
