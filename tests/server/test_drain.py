"""The Drain RPC on a single real server (the fleet's drain, windows released and a node
killed after it: tests/fleet/test_drain.py): memory-acked sessions written back, new
writes refused UNAVAILABLE while reads go on, the windows held counted, a bad interval
refused, and only an admin may drain a server that authenticates."""

from __future__ import annotations

import asyncio

import pytest

from kvtier import AsyncClient, InvalidRequest, PermissionDenied, RetryPolicy, TierUnavailable
from services.cli.main import main
from tests.support.security import dev_set, secured_server
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for, window_for

TOKENS = LAYOUT.chunk_tokens + 20


async def test_drain_writes_back_refuses_writes_and_keeps_serving_reads(tmp_path):
    async with running_server(tmp_path, host_bytes=8 << 20) as (server, target):
        async with AsyncClient(target) as kv:
            for i in range(3):
                await kv.spill("acme", f"s{i}", LAYOUT.name, tokens_for(TOKENS, i),
                               streams_for(LAYOUT, TOKENS, seed=i), generation=1,
                               window=window_for(LAYOUT, TOKENS), ack="memory")
            seen = []
            last = await kv.drain(seen.append, progress_interval_s=0.1)
            assert last.done and last.phase == "done" and seen[-1] == last
            assert [step.phase for step in seen][0] == "writes"
            assert last.writeback_pending == 0 and last.writeback_failed == 0
            assert server.manager.store.durability.queue.depth == 0
            assert last.windows_held == 3 and last.windows_released == 0  # no fleet
            got = await kv.restore("acme", "s1")  # reads go on
            assert got.token_ids.tolist() == tokens_for(TOKENS, 1).tolist()
            again = await kv.drain()  # joins: still drained
            assert again.done
        async with AsyncClient(target, retry=RetryPolicy(attempts=1)) as kv:
            with pytest.raises(TierUnavailable, match="draining"):
                await kv.spill("acme", "new", LAYOUT.name, tokens_for(TOKENS),
                               streams_for(LAYOUT, TOKENS), generation=1)
            with pytest.raises(TierUnavailable, match="draining"):
                await kv.fork("acme", "s0", "s0-copy", upto_tokens=LAYOUT.chunk_tokens)
            with pytest.raises(InvalidRequest, match="progress_interval_s"):
                await kv.drain(progress_interval_s=-1)


async def test_kvtier_drain_prints_progress_on_stderr_and_the_outcome_on_stdout(
        tmp_path, capsys):
    async with running_server(tmp_path) as (_, target):
        async with AsyncClient(target) as kv:
            await kv.spill("acme", "s1", LAYOUT.name, tokens_for(TOKENS),
                           streams_for(LAYOUT, TOKENS), generation=1,
                           window=window_for(LAYOUT, TOKENS), ack="memory")
        assert await asyncio.to_thread(main, ["drain", "--server", target]) == 0
        said = capsys.readouterr()
        assert "kvtier drain: writes" in said.err and "kvtier drain: done" in said.err
        assert said.out.startswith(f"{target} drained: every session durable")
        assert "1 windows go with the process" in said.out


async def test_only_an_admin_drains_a_server_that_authenticates(tmp_path):
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs) as (server, target):
        async with certs.client(target, "acme") as tenant:
            with pytest.raises(PermissionDenied):
                await tenant.drain()
        assert not server.manager.draining.active
        async with certs.client(target, "admin") as admin:
            assert (await admin.drain()).done
        assert server.manager.draining.active
