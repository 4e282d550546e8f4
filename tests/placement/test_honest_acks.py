"""Honest memory acks over a real server: a memory-acked spill whose write-back fails
(the disk tier full of other sessions' last copies) is reported by Stat, Restore and
Resume and counted in kvtier_writeback_failures_total, after a restart too (instead of a
DATA_LOSS nobody was told about); once space returns and a retried write-back succeeds,
the mark clears and the session survives a restart."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.format.errors import DataLoss
from kvtier import AsyncClient
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    streams_for,
    tokens_for,
    window_for,
)

TOKENS = 2 * LAYOUT.chunk_tokens + 8  # two chunks (~19 KB each on disk) and a tail
# Room on the disk for one session's chunks, not two; no object tier, so the disk is the
# only durable tier.
SMALL_DISK = {"disk_bytes": 48 * 1024, "object_bytes": 0}
POLL_S = 0.05
WAIT_S = 60  # only so a regression fails instead of hanging


async def _until_marked(kv: AsyncClient, session_id: str, marked: bool) -> None:
    async def poll() -> None:
        while (await kv.stat("acme", session_id)).session.writeback_failed != marked:
            await asyncio.sleep(POLL_S)
    await asyncio.wait_for(poll(), WAIT_S)


async def _fill_disk_then_spill_in_memory(kv: AsyncClient):
    await kv.spill("acme", "keep", LAYOUT.name, tokens_for(TOKENS, seed=1),
                   streams_for(LAYOUT, TOKENS, seed=1), generation=1, ack="durable")
    persistent = streams_for(LAYOUT, TOKENS, seed=2)
    result = await kv.spill("acme", "s1", LAYOUT.name, tokens_for(TOKENS, seed=2), persistent,
                            window=window_for(LAYOUT, TOKENS), generation=1, ack="memory")
    assert not result.durable
    return persistent


def _failures(server) -> float:
    return server.metrics.registry.get_sample_value("kvtier_writeback_failures_total")


async def test_failed_write_back_is_reported_until_space_returns(tmp_path):
    async with running_server(tmp_path, **SMALL_DISK) as (server, target), \
            AsyncClient(target) as kv:
        persistent = await _fill_disk_then_spill_in_memory(kv)
        await _until_marked(kv, "s1", True)
        assert not (await kv.stat("acme", "keep")).session.writeback_failed
        assert _failures(server) == 1
        [listed] = [s for s in await kv.list("acme") if s.session.session_id == "s1"]
        assert listed.writeback_failed
        restored = await kv.restore("acme", "s1")  # still held in host RAM
        assert restored.writeback_failed
        assert_streams_equal(restored.persistent, persistent)
        resumed = await kv.resume("acme", "s1")
        assert resumed.writeback_failed and not resumed.replayed
        # Space returns: the retried write-back lands and the mark clears, no restart.
        await kv.delete("acme", "keep")
        await _until_marked(kv, "s1", False)
        assert not (await kv.restore("acme", "s1", decode=False)).writeback_failed
        assert _failures(server) == 1  # counted once, when it failed
    async with running_server(tmp_path, **SMALL_DISK) as (_, target), \
            AsyncClient(target) as kv:
        restored = await kv.restore("acme", "s1")  # from the disk now
        assert not restored.writeback_failed
        assert_streams_equal(restored.persistent, persistent)


async def test_a_restart_reports_the_failed_write_back_not_a_surprise(tmp_path):
    async with running_server(tmp_path, **SMALL_DISK) as (_, target), \
            AsyncClient(target) as kv:
        await _fill_disk_then_spill_in_memory(kv)
        await _until_marked(kv, "s1", True)
    # The mark was persisted with the manifest; the chunks lived in host RAM only.
    async with running_server(tmp_path, **SMALL_DISK) as (_, target), \
            AsyncClient(target) as kv:
        assert (await kv.stat("acme", "s1")).session.writeback_failed
        with pytest.raises(DataLoss, match="write-back to a durable tier failed"):
            await kv.restore("acme", "s1")
        assert not (await kv.stat("acme", "keep")).session.writeback_failed
        await kv.restore("acme", "keep")


async def test_a_newer_spill_that_is_durable_clears_the_mark(tmp_path):
    async with running_server(tmp_path, **SMALL_DISK) as (_, target), \
            AsyncClient(target) as kv:
        persistent = await _fill_disk_then_spill_in_memory(kv)
        await _until_marked(kv, "s1", True)
        await kv.delete("acme", "keep")
        # The same chunks at a newer generation, acked durable: copied to the disk now.
        result = await kv.spill("acme", "s1", LAYOUT.name, tokens_for(TOKENS, seed=2),
                                persistent, generation=2, ack="durable")
        assert result.durable
        assert not (await kv.stat("acme", "s1")).session.writeback_failed
    async with running_server(tmp_path, **SMALL_DISK) as (_, target), \
            AsyncClient(target) as kv:
        restored = await kv.restore("acme", "s1")
        assert restored.generation == 2 and not restored.writeback_failed
        assert_streams_equal(restored.persistent, persistent)
