"""Restarts between spill and resume: nothing acknowledged as durable is lost, whether the
server stopped gracefully (write-back drained) or was killed (SIGKILL) right after a
durable acknowledgement."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvstore.format.errors import StaleGeneration
from kvtier import AsyncClient, Client
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    serve_child,
    streams_for,
    tokens_for,
    window_for,
)

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 2 * LAYOUT.chunk_tokens + 8


async def test_graceful_restart_keeps_memory_acked_sessions(tmp_path):
    tokens = tokens_for(TOKENS)
    persistent = streams_for(LAYOUT, TOKENS)
    window = window_for(LAYOUT, TOKENS)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        result = await kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, window=window,
                                generation=3, ack="memory")
        assert not result.durable
    # stop() drained the write-back queue: the chunks reached the disk tier.
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        restored = await kv.restore("acme", "s1")
        assert restored.generation == 3
        assert_streams_equal(restored.persistent, persistent)
        assert restored.replay_needed  # the window lived in host RAM only
        with pytest.raises(StaleGeneration):
            await kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, generation=3)
        await kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, generation=4)


@pytest.mark.slow  # two server processes, each importing torch: ~20 s on the dev machine
def test_durable_ack_survives_sigkill(tmp_path):
    tokens = tokens_for(TOKENS, seed=5)
    persistent = streams_for(LAYOUT, TOKENS, seed=5)
    process, target = serve_child(tmp_path, log_level="WARNING")
    try:
        with Client(target) as kv:
            result = kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, generation=1,
                              ack="durable")
            assert result.durable
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
    finally:
        process.kill()
    process, target = serve_child(tmp_path, log_level="WARNING")
    try:
        with Client(target) as kv:
            restored = kv.restore("acme", "s1")
            assert_streams_equal(restored.persistent, persistent)
            assert restored.token_ids.tolist() == tokens.tolist()
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0  # SIGTERM: a graceful stop
