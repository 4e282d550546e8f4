"""Disk tier admission (kvstore.tiers.disk.admission): a block's digest is checked when it
is written, marked in its record, proved on every intact read, carried by compaction and
repair; and a restore still hashes whatever the tier cannot prove, so other bytes under a
block key never come back as the chunk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.format.errors import DataLoss
from kvstore.format.keys import block_key, chunk_digest
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk.segments import ADMITTED, HEADER, segment_path
from tests.support.manager import make_session, random_tokens, running_manager

MB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
CHAIN = "ab" * 16


def flags_of(tier: DiskTier, key: str) -> int:
    entry = tier.index.lookup(key.encode())
    with open(segment_path(tier.segment_dir, entry.seg_id), "rb") as file:
        file.seek(entry.offset)
        return HEADER.unpack(file.read(HEADER.size))[3]


async def test_only_bytes_with_their_keys_digest_are_admitted_and_proved(tmp_path, opened):
    tier = opened.adopt(DiskTier(tmp_path, 64 * MB, segment_bytes=1 << 16))
    good, other = b"the chunk" * 1000, b"other bytes" * 1000
    admitted, wrong = block_key(CHAIN, chunk_digest(good)), block_key("cd" * 16,
                                                                        chunk_digest(good))
    await tier.put_many([(admitted, good), (wrong, other), ("plain", good)])
    await tier.put("large", bytes(1 << 19))  # a single put, hashed off the loop
    values, proven = await tier.get_many_proven([admitted, wrong, "plain", "missing"])
    assert [bytes(v) for v in values[:3]] == [good, other, good]
    assert proven == [True, False, False, False]
    assert flags_of(tier, admitted) == ADMITTED and flags_of(tier, wrong) == 0
    assert [bytes(v) for v in await tier.get_many([admitted, wrong])] == [good, other]


async def test_the_mark_survives_compaction_and_repair(tmp_path, opened):
    path = tmp_path / "disk"
    tier = DiskTier(path, 64 * MB, segment_bytes=1 << 14)
    blocks = {block_key(CHAIN, chunk_digest(v)): v for v in
              (bytes([i]) * 6000 for i in range(6))}
    for key, value in blocks.items():
        await tier.put(key, value)
    first = next(iter(blocks))
    await tier.put("filler", bytes(6000))
    await tier.delete("filler")
    sealed = [s.seg_id for s in tier.segments() if s.state.name == "SEALED"]
    await tier.rewrite_segments(sealed)
    assert (await tier.get_many_proven(list(blocks)))[1] == [True] * len(blocks)
    await tier.close()
    (path / "index" / "data.mdb").unlink()
    done = subprocess.run([sys.executable, "-m", "services.cli", "repair", "--data-dir",
                           str(path), "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    tier = opened.adopt(DiskTier(path, 64 * MB, segment_bytes=1 << 14))
    values, proven = await tier.get_many_proven(list(blocks))
    assert proven == [True] * len(blocks) and bytes(values[0]) == blocks[first]


async def test_a_block_key_holding_other_bytes_is_not_restored(tmp_path):
    """The disk holds other (valid) bytes under a chunk's block key: not admitted, so
    the restore hashes them, finds the wrong digest and reports DataLoss."""
    args = make_session(random_tokens(16 * 3, seed=5), window=False)
    other = make_session(random_tokens(16 * 3, seed=5), seed=9, window=False)
    disk = DiskTier(tmp_path / "disk", 64 * MB)
    async with running_manager([disk], disk.meta) as manager:
        await manager.spill("t", "s", generation=1, ack="durable", **args)
        key = args["chunks"][1][0]
        await disk.put(key, other["chunks"][1][1])  # same tokens, other bytes
        assert (await disk.get_many_proven([key]))[1] == [False]
        with pytest.raises(DataLoss, match="digest"):
            await manager.restore("t", "s")
