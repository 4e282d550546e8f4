"""Client-side routing (``kvtier.routing``) over a real fleet: two real servers sharing a
moto S3 bucket and a real redis-server, metadata = "shared". A client given
``servers=[...]`` sends a session's resume to the node holding its window (Stat asked
once, then cached), falls back to another node when that one is down (replaying the
window, the tensors still exact), and corrects a cached home the session has left.
Which node served a call is read from each server's own request counters."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvtier import AsyncClient, Client
from kvtier.channel import Credentials
from kvtier.routing import Router, RoutingPolicy, open_node
from services.server.config_load import load_config
from services.server.server import create_server
from tests.support.clock import ManualClock
from tests.support.fleet import SPEC, TOKENS, assert_persistent, assert_same_window


@contextlib.asynccontextmanager
async def two_nodes(tmp_path, shared: dict, redis_url: str):
    """Servers a and b: name -> (server, address); each stopped at the end."""
    nodes = {}
    try:
        for name in "ab":
            server, port = await create_server(load_config(preset="test", env={}, overrides={
                **shared, "redis_url": redis_url, "node_id": name,
                "data_dir": tmp_path / name, "listen": "127.0.0.1:0"}))
            nodes[name] = (server, f"127.0.0.1:{port}")
        yield nodes
    finally:
        for server, _ in nodes.values():
            await server.stop(0.5)


def calls(nodes: dict, method: str) -> dict[str, int]:
    """name -> the OK calls of ``method`` that node served."""
    return {name: int(server.metrics.registry.get_sample_value(
        "kvtier_requests_total", {"method": method, "code": "OK"}) or 0)
        for name, (server, _) in nodes.items()}


async def spill_on(address: str, model_state) -> None:
    _, ids, chunks, tail, window = model_state
    async with AsyncClient(address) as kv:
        spilled = await kv.spill("acme", "s1", SPEC, ids, chunks=chunks, tail=tail,
                                 window=window, generation=1, ack="durable")
    assert spilled.window_kept


async def test_a_resume_goes_to_the_home_node_and_its_route_is_cached(
        tmp_path, fleet_env, redis_server, model_state):
    _, ids, chunks, tail, window = model_state
    async with two_nodes(tmp_path, fleet_env, redis_server) as nodes:
        a, b = nodes["a"][1], nodes["b"][1]
        await spill_on(a, model_state)
        async with AsyncClient(servers=[b, a]) as kv:
            first = await kv.resume("acme", "s1")
            assert calls(nodes, "Resume") == {"a": 1, "b": 0}  # b is first, a holds it
            assert not first.replayed and bytes(first.window_blob) == window
            assert_persistent(first, chunks, tail)
            stats = sum(calls(nodes, "Stat").values())
            assert stats == 1
            second = await kv.resume("acme", "s1")
            assert not second.replayed
            assert calls(nodes, "Resume") == {"a": 2, "b": 0}
            assert sum(calls(nodes, "Stat").values()) == stats  # the cached route
            # A spill goes to the session's home, which stays where it was.
            await kv.spill("acme", "s1", SPEC, ids, chunks=chunks, tail=tail, window=window,
                           generation=2, ack="durable")
            assert calls(nodes, "Spill") == {"a": 2, "b": 0}
            # A new session's spill goes to its chosen node, its home from then on.
            before = calls(nodes, "Spill")
            await kv.spill("acme", "s2", SPEC, ids, chunks=chunks, tail=tail, window=window,
                           generation=1, ack="durable")
            [home] = [name for name, n in calls(nodes, "Spill").items() if n > before[name]]
            resumed = calls(nodes, "Resume")
            assert not (await kv.resume("acme", "s2")).replayed
            assert sum(calls(nodes, "Stat").values()) == stats  # none: it was spilled there
            assert calls(nodes, "Resume")[home] == resumed[home] + 1


async def test_with_the_home_node_down_a_resume_falls_back_and_replays_exactly(
        tmp_path, fleet_env, redis_server, model_state):
    _, _, chunks, tail, window = model_state
    async with two_nodes(tmp_path, fleet_env, redis_server) as nodes:
        a, b = nodes["a"][1], nodes["b"][1]
        await spill_on(a, model_state)
        kv = Client(servers=[b, a])  # the blocking client: its calls in a thread
        try:
            assert not (await asyncio.to_thread(kv.resume, "acme", "s1")).replayed
            await nodes["a"][0].stop(0.5)
            moved = await asyncio.to_thread(kv.resume, "acme", "s1", replay_tokens=TOKENS)
            assert moved.replayed  # on b, which had no window to give
            assert_persistent(moved, chunks, tail)
            assert_same_window(moved.window_blob, window, moved.token_ids)
            assert calls(nodes, "Resume")["b"] == 1
            # b kept the rebuilt window: asked again, Stat names b, and no replay.
            again = await asyncio.to_thread(kv.resume, "acme", "s1")
            assert not again.replayed and calls(nodes, "Resume")["b"] == 2
            assert bytes(again.window_blob) == bytes(moved.window_blob)
        finally:
            await asyncio.to_thread(kv.close)


async def test_a_cached_home_the_session_left_is_corrected(
        tmp_path, fleet_env, redis_server, model_state):
    _, _, chunks, tail, window = model_state
    async with two_nodes(tmp_path, fleet_env, redis_server) as nodes:
        a, b = nodes["a"][1], nodes["b"][1]
        await spill_on(a, model_state)
        async with AsyncClient(servers=[a, b]) as kv, AsyncClient(b) as other:
            await kv.resume("acme", "s1")  # cached: a
            await other.resume("acme", "s1", replay_tokens=TOKENS)  # now held by b
            assert (await other.stat("acme", "s1")).session.window_node_address == b
            stats = sum(calls(nodes, "Stat").values())
            stale = await kv.resume("acme", "s1", replay_tokens=TOKENS)
            assert stale.replayed  # a no longer held it: the route is dropped
            assert_persistent(stale, chunks, tail)
            assert_same_window(stale.window_blob, window, stale.token_ids)
            home = (await other.stat("acme", "s1")).session.window_node_address
            served = calls(nodes, "Resume")
            fresh = await kv.resume("acme", "s1")
            assert not fresh.replayed  # routed to where Stat says the window is now
            assert sum(calls(nodes, "Stat").values()) == stats + 2  # the route + ours
            name = "a" if home == a else "b"
            assert calls(nodes, "Resume")[name] == served[name] + 1


async def test_the_route_cache_is_bounded_expires_and_skips_a_node_in_cool_down():
    clock = ManualClock()
    nodes = [open_node(f"127.0.0.1:{port}", Credentials(), []) for port in (1, 2, 3)]
    router = Router(nodes, RoutingPolicy(entries=2, ttl_s=10.0, cooldown_s=5.0), clock)
    try:
        for i in range(3):
            router.remember(("t", f"s{i}"), nodes[i])
        assert router.cached(("t", "s0")) is None  # the least recently used, dropped
        assert router.cached(("t", "s2")) is nodes[2]
        clock.advance(10.0)
        assert router.cached(("t", "s2")) is None  # past its TTL
        router.remember(("t", "s1"), nodes[1])
        router.failed(nodes[1], None)
        assert router.cached(("t", "s1")) is None  # routed to a node that failed
        assert router.any() is nodes[0]
        assert router.share(3.0) == 1.5  # the time left over the two nodes up
        router.failed(nodes[0], None)
        assert router.any() is nodes[2]
        assert router.share(3.0) == 3.0 and router.share(None) is None
        assert {router.chosen(("t", f"s{i}")) for i in range(20)} == {nodes[2]}
        clock.advance(5.0)
        assert router.any() is nodes[0]  # back after its cool-down
        assert len({router.chosen(("t", f"s{i}")) for i in range(20)}) > 1
    finally:
        for node in nodes:
            await node.channel.close()


def test_target_and_servers_exclude_each_other():
    with pytest.raises(ValueError, match="not both"):
        AsyncClient("127.0.0.1:1", servers=["127.0.0.1:2"])
    with pytest.raises(ValueError, match="no server"):
        AsyncClient(servers=[])
