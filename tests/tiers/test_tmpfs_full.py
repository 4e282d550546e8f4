"""A real full disk: a server (a subprocess, or in this process) whose data directory is
a 20 MiB tmpfs.

Durable spills fill the medium (the disk tier's own capacity is larger) until the server
answers RESOURCE_EXHAUSTED; deleting sessions then makes room again without a restart
(their chunks stay retained as cache until the full medium makes them give way; online
reclamation then frees the dead segments), and every durable-acked session not deleted
still restores bit-exact, before and after a restart. With the object tier in
``data_dir/objects`` (the same medium) the chunks the full disk sheds must not take the
space back there.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.format.errors import TierFull
from kvtier import AsyncClient, Client
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    serve_child,
    stop_child,
    streams_for,
    tokens_for,
)

TOKENS = 16 * LAYOUT.chunk_tokens  # sixteen chunks, ~300 KB on disk
MAX_SPILLS = 200  # 20 MiB holds fewer than 80 of them
CONFIG = """
host_bytes = "2MiB"
disk_bytes = "1GiB"
object_bytes = 0
disk_segment_bytes = "1MiB"
disk_reclaim_dead_fraction = 0.5
disk_reclaim_interval_s = 0.05
"""



@pytest.fixture
def tmpfs(tmpfs_factory):
    return tmpfs_factory(20)


def _spill(kv: Client, n: int) -> None:
    kv.spill("acme", f"s{n}", LAYOUT.name, tokens_for(TOKENS, seed=n),
             streams_for(LAYOUT, TOKENS, seed=n), generation=1, ack="durable")


def _restores_exactly(kv: Client, kept: list[int]) -> None:
    for n in kept:
        restored = kv.restore("acme", f"s{n}", want_window=False)
        assert_streams_equal(restored.persistent, streams_for(LAYOUT, TOKENS, seed=n))


@pytest.mark.slow  # a server process importing torch, ~100 spills
def test_a_full_tmpfs_refuses_spills_then_serves_again_after_deletes(tmpfs, tmp_path):
    config = tmp_path / "kvtier.toml"
    config.write_text(CONFIG)
    process, target = serve_child(tmpfs, config)
    try:
        with Client(target) as kv:
            stored = []
            for n in range(MAX_SPILLS):
                try:
                    _spill(kv, n)
                except TierFull:
                    break
                stored.append(n)
            else:
                pytest.fail(f"{MAX_SPILLS} spills never filled a 20 MiB tmpfs")
            assert len(stored) > 4
            _restores_exactly(kv, stored)  # nothing acked was lost to the full medium
            deleted, kept = stored[: len(stored) // 2], stored[len(stored) // 2:]
            for n in deleted:
                kv.delete("acme", f"s{n}")
            more = list(range(MAX_SPILLS, MAX_SPILLS + 3))
            for n in more:  # room again: reclamation freed the dead segments
                _spill_when_reclaimed(kv, n)
            kept += more
            _restores_exactly(kv, kept)
    finally:
        stop_child(process)
    process, target = serve_child(tmpfs, config)
    try:
        with Client(target) as kv:
            _restores_exactly(kv, kept)
    finally:
        stop_child(process)


def _spill_when_reclaimed(kv: Client, n: int, attempts: int = 300) -> None:
    """Spill ``n``, waiting while reclamation (every 0.05 s) has not freed room yet."""
    for _ in range(attempts):
        try:
            return _spill(kv, n)
        except TierFull:
            time.sleep(0.1)
    pytest.fail(f"spill {n} still refused after the deletes: no space came back")


async def _spill_async(kv: AsyncClient, name: str, seed: int) -> None:
    await kv.spill("acme", name, LAYOUT.name, tokens_for(TOKENS, seed=seed),
                   streams_for(LAYOUT, TOKENS, seed=seed), generation=1, ack="durable")


async def test_deletes_relieve_a_full_medium_shared_with_the_object_directory(tmpfs):
    """The object tier in data_dir/objects: deleting every session gives the space back,
    so spills are admitted again at once, and after a restart."""
    settings = dict(host_bytes=2 << 20, disk_bytes=1 << 30, object_bytes=1 << 30,
                    disk_segment_bytes=1 << 20, disk_reclaim_dead_fraction=0.5,
                    disk_reclaim_interval_s=0.05)
    async with running_server(tmpfs, **settings) as (_, target), AsyncClient(target) as kv:
        stored = 0
        while stored < MAX_SPILLS:
            try:
                await _spill_async(kv, f"s{stored}", stored)
            except TierFull:
                break
            stored += 1
        assert 4 < stored < MAX_SPILLS
        for n in range(stored):
            await kv.delete("acme", f"s{n}")
        # the old main moved the deleted chunks into objects/ (the same medium) on every
        # refused spill and stayed RESOURCE_EXHAUSTED: each spill here needs at most a
        # reclamation round's wait
        for n in range(stored // 2):
            await _spill_async_when_reclaimed(kv, f"again{n}", MAX_SPILLS + n)
    async with running_server(tmpfs, **settings) as (_, target), AsyncClient(target) as kv:
        for n in range(stored // 2, stored // 2 + 3):
            await _spill_async_when_reclaimed(kv, f"again{n}", MAX_SPILLS + n)
        for n in range(stored // 2 + 3):
            restored = await kv.restore("acme", f"again{n}", want_window=False)
            assert_streams_equal(restored.persistent,
                                 streams_for(LAYOUT, TOKENS, seed=MAX_SPILLS + n))


async def _spill_async_when_reclaimed(kv: AsyncClient, name: str, seed: int,
                                      attempts: int = 20) -> None:
    """Spill, retrying while a reclamation round (every 0.05 s) has not run yet: a few
    tries, where a medium that never gives space back refuses every one."""
    for _ in range(attempts):
        try:
            return await _spill_async(kv, name, seed)
        except TierFull:
            await asyncio.sleep(0.1)
    pytest.fail(f"spill {name} still refused after the deletes: no space came back")
