"""A disk outage must not look like a full disk: after one EIO the tier stack
skips the disk tier for its cooldown, and a durable spill in that window is
TierUnavailable (UNAVAILABLE: retry later), not TierFull (RESOURCE_EXHAUSTED: free
space); once the cooldown ends the healed disk takes spills again. A durable write the
disk refuses leaves nothing a lookup or read finds."""

from __future__ import annotations

import asyncio
import dataclasses
import errno

import pytest

from kvstore.format.errors import TierFull, TierUnavailable
from kvstore.format.keys import split_block_key
from kvstore.format.registry import get_layout
from kvstore.session.manager import MANAGER_PRESETS, TierManager
from kvstore.session.prefix_chunks import ChunkWrite
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from testing.faultfs import FaultyFileSystem
from testing.power_loss import TENANT, Spill, crash_layout, session_args
from tests.support.manager import Managers

COOLDOWN_S = 1.0


async def open_manager(managers: Managers, tmp_path, fs: FaultyFileSystem, with_memory: bool
                       ) -> tuple[TierManager, DiskTier]:
    disk = DiskTier(tmp_path, 1 << 26, segment_bytes=1 << 16, fs=fs)
    tiers = [HostTier(1 << 24, pin_memory=False), disk] if with_memory else [disk]
    config = dataclasses.replace(MANAGER_PRESETS["default"],
                                 unavailable_cooldown_s=COOLDOWN_S)
    return await managers.open(tiers, disk.meta, config=config), disk


async def spill(manager: TierManager, session: str, generation: int) -> dict:
    args = session_args(crash_layout(), Spill(session, generation, 40))
    await manager.spill(TENANT, session, generation=generation, ack="durable", **args)
    return args


@pytest.mark.parametrize("with_memory", [False, True], ids=["disk-only", "host-over-disk"])
async def test_spill_in_an_outage_cooldown_is_unavailable_not_full(tmp_path, with_memory,
                                                                  managers):
    fs = FaultyFileSystem()
    manager, disk = await open_manager(managers, tmp_path, fs, with_memory)
    stack = manager.store.stack
    j = stack.index(disk.name)
    kept = await spill(manager, "before", 1)
    fs.fail("write", errno.EIO)  # one failed write: the disk is healthy again after it
    with pytest.raises(TierUnavailable):
        await spill(manager, "hit", 1)
    assert fs.injected == {"write": 1} and not stack.up(j)
    writes = fs.calls["write"]
    with pytest.raises(TierUnavailable) as raised:  # the old main raised TierFull here
        await spill(manager, "in-cooldown", 1)
    assert not isinstance(raised.value, TierFull)
    assert fs.calls["write"] == writes, "the disk was skipped, not asked"
    assert not stack.up(j), "the spill ran within the cooldown"
    while not stack.up(j):  # the cooldown ends; nothing else changed
        await asyncio.sleep(COOLDOWN_S / 20)
    after = await spill(manager, "after", 1)
    for session, args in (("before", kept), ("after", after)):
        got = await manager.restore(TENANT, session)
        assert [bytes(c) for c in got.chunks] == [bytes(c) for _, c in args["chunks"]]
    await managers.close(manager)


async def test_a_truly_full_durable_tier_is_still_full(tmp_path, managers):
    fs = FaultyFileSystem()
    manager, disk = await open_manager(managers, tmp_path, fs, with_memory=True)
    fs.fail("write", errno.ENOSPC, times=None)  # the medium is full, not out
    with pytest.raises(TierFull):
        await spill(manager, "full", 1)
    assert manager.store.stack.up(manager.store.stack.index(disk.name))
    fs.heal()
    await spill(manager, "room-again", 1)
    await managers.close(manager)


@pytest.mark.parametrize("call", ["spill", "write_chunks"])
async def test_a_durable_write_the_disk_refuses_leaves_nothing_visible(tmp_path, call, managers):
    """Every write path: a durable ack the disk cannot give is refused, and the copies
    it put in host memory go with it (the old main kept them there as cache, so Lookup
    reported them held and ReadChunks returned bytes never acknowledged)."""
    fs = FaultyFileSystem()
    disk = DiskTier(tmp_path, 1 << 26, segment_bytes=1 << 16, fs=fs)
    config = dataclasses.replace(MANAGER_PRESETS["default"], retain_unreferenced=True,
                                 unavailable_cooldown_s=COOLDOWN_S)
    manager = await managers.open([HostTier(1 << 24, pin_memory=False), disk], disk.meta,
                                  config=config)
    args = session_args(crash_layout(), Spill("s", 1, 40))
    spec = get_layout(args["layout_id"])
    tokens = args["token_ids"][: len(args["chunks"]) * spec.chunk_tokens]
    fs.fail("write", errno.EIO, times=None)
    with pytest.raises(TierUnavailable):
        if call == "spill":
            await manager.spill(TENANT, "s", generation=1, ack="durable", **args)
        else:
            await manager.write_chunks(ChunkWrite(
                tenant=TENANT, layout_id=spec.layout_id, token_ids=tokens, first_chunk=0,
                digests=[split_block_key(key)[1] for key, _ in args["chunks"]],
                chunks={i: data for i, (_, data) in enumerate(args["chunks"])},
                ack="durable"))
    assert not manager.lookup(TENANT, spec.layout_id, tokens).chunks
    assert all(manager.where(key) == [] for key, _ in args["chunks"])
    got = await manager.read_chunks(TENANT, spec.layout_id, tokens, first_chunk=0,
                                    count=len(args["chunks"]))
    assert {r.missing for r in got} == {"not_held"}
    await managers.close(manager)
