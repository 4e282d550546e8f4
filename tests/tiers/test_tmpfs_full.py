"""A real full disk: a server subprocess whose data directory is a 20 MiB tmpfs.

Durable spills fill the medium (the disk tier's own capacity is larger) until the server
answers RESOURCE_EXHAUSTED; deleting sessions then makes room again without a restart
(their chunks stay retained as cache until the full medium makes them give way; online
reclamation then frees the dead segments), and every durable-acked session not deleted
still restores bit-exact, before and after a restart.
"""

from __future__ import annotations

import time

import pytest

from kvstore.format.errors import TierFull
from kvtier import Client
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
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

pytestmark = pytest.mark.slow  # a server process importing torch, ~100 spills


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
