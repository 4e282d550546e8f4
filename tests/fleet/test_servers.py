"""A fleet of real kvtier servers (docs/fleet.md, README "Running a fleet"): three
servers over gRPC sharing one moto S3 bucket (the truth: chunks and manifests) and one
real three-master Redis Cluster (a shared chunk cache), metadata = "shared". Any node
resumes any session; windows stay home and other nodes replay them (the bundled
model's architecture in process, random weights); generations are compare-and-swap
across nodes; a node killed with SIGKILL mid-spill loses nothing it acknowledged
durable; a Redis master down leaves the bucket to serve."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from kvstore.format.errors import (
    GenerationConflict,
    InvalidRequest,
    SessionNotFound,
    StaleGeneration,
)
from kvtier import AsyncClient
from services import cli
from services.server.config import ServerConfig
from services.server.config_load import load_config
from services.server.server import create_server
from testing.live_server import Child
from tests.support.fleet import SPEC, TOKENS, assert_persistent, assert_same_window, fleet

ROOT = Path(__file__).resolve().parents[2]


async def test_spill_on_a_resumes_on_b_and_c_and_stat_names_the_window_node(
        tmp_path, fleet_env, redis_cluster, model_state, capsys):
    _, ids, chunks, tail, window = model_state
    async with fleet(tmp_path, fleet_env, redis_cluster) as nodes:
        a, b, c = nodes["a"], nodes["b"], nodes["c"]
        async with AsyncClient(a) as on_a, AsyncClient(b) as on_b, AsyncClient(c) as on_c:
            spilled = await on_a.spill("acme", "s1", SPEC, ids, chunks=chunks, tail=tail,
                                       window=window, generation=1, ack="durable")
            assert spilled.durable and spilled.window_kept
            for kv, node in ((on_a, "a"), (on_b, "b"), (on_c, "c")):
                reply = await kv.stat("acme", "s1")
                assert reply.node_id == node
                assert reply.session.window_node_id == "a"  # a router sends it to a
                assert reply.session.window_node_address == a

            home = await on_a.resume("acme", "s1")  # a's host tier: no replay
            assert not home.replayed and home.window_tier == "host"
            assert bytes(home.window_blob) == window
            assert_persistent(home, chunks, tail)

            plain = await on_c.restore("acme", "s1", want_window=False)
            assert_persistent(plain, chunks, tail)
            assert (await on_c.stat("acme", "s1")).session.window_node_id == "a"  # unmoved

            moved = await on_b.resume("acme", "s1", replay_tokens=TOKENS)
            assert moved.replayed and moved.replay_tokens == TOKENS
            assert_persistent(moved, chunks, tail)
            assert_same_window(moved.window_blob, window, moved.token_ids)
            # b kept the rebuilt window: the session's home is now b, for every node.
            assert (await on_c.stat("acme", "s1")).session.window_node_id == "b"
            again = await on_b.resume("acme", "s1")
            assert not again.replayed and bytes(again.window_blob) == bytes(moved.window_blob)

            elsewhere = await on_c.resume("acme", "s1", replay_tokens=TOKENS)
            assert elsewhere.replayed
            assert_persistent(elsewhere, chunks, tail)
            assert_same_window(elsewhere.window_blob, window, elsewhere.token_ids)

        argv = ["stat", "--session", "acme/s1", "--server", a, "--json"]
        assert await asyncio.to_thread(cli.main, argv) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["nodeId"] == "a"
        assert shown["session"]["windowNodeId"] == "c"
        assert shown["session"]["windowNodeAddress"] == c
        assert await asyncio.to_thread(cli.main, argv[:-1]) == 0
        assert f"window node c at {c}" in capsys.readouterr().out


async def test_two_replicas_race_each_generation_over_grpc_and_exactly_one_wins(
        tmp_path, fleet_env, redis_cluster, model_state):
    _, ids, chunks, _, _ = model_state
    rounds = 8
    async with fleet(tmp_path, fleet_env, redis_cluster) as nodes:
        targets = [nodes[name] for name in "abc"]
        async with AsyncClient(targets[0]) as on_a, AsyncClient(targets[1]) as on_b, \
                AsyncClient(targets[2]) as reader:
            await on_a.spill("acme", "s1", SPEC, ids[:512], chunks=chunks[:1], tail=b"",
                             generation=1, ack="durable")
            for generation in range(2, 2 + rounds):
                # Two different states of the session, one per replica, same generation.
                offers = [ids[:512 * (1 + generation % 2)], ids[:512 * (2 - generation % 2)]]
                outcomes = await asyncio.gather(*(
                    kv.spill("acme", "s1", SPEC, tokens, chunks=chunks[:len(tokens) // 512],
                             tail=b"", generation=generation, ack="durable")
                    for kv, tokens in zip((on_a, on_b), offers, strict=True)),
                    return_exceptions=True)
                won = [i for i, o in enumerate(outcomes) if not isinstance(o, BaseException)]
                assert len(won) == 1, outcomes
                loser = outcomes[1 - won[0]]
                assert isinstance(loser, StaleGeneration | GenerationConflict), loser
                stored = await reader.restore("acme", "s1", want_window=False)
                winner = offers[won[0]]
                assert stored.generation == generation  # never torn, never mixed
                assert stored.token_ids.tolist() == winner.tolist()
                assert_persistent(stored, chunks[:len(winner) // 512], b"")


def child_config(path: Path, shared: dict, redis_url: str, name: str, data_dir: Path) -> Path:
    """A TOML config file for a ``kvtier serve`` child of the fleet."""
    values = {**shared, "redis_url": redis_url, "node_id": name, "preset": "test",
              "data_dir": str(data_dir), "listen": "127.0.0.1:0", "replay": "off"}
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items()))
    return path


async def test_a_node_killed_mid_spill_loses_no_durable_session(
        tmp_path, fleet_env, redis_cluster, model_state):
    _, ids, chunks, _, _ = model_state
    config = child_config(tmp_path / "a.toml", fleet_env, redis_cluster, "a", tmp_path / "a")
    a = Child([sys.executable, "-m", "services.cli", "serve", "--config", str(config),
               "--log-level", "WARNING"], "kvtier serving on ", tmp_path / "a.log",
              {"PYTHONPATH": str(ROOT)})
    acked: dict[str, int] = {}  # session -> tokens of its acknowledged durable spill
    async with fleet(tmp_path, fleet_env, redis_cluster, names="b") as nodes:
        target = await asyncio.to_thread(a.start)
        try:
            async def spiller(worker: int) -> None:
                async with AsyncClient(target, timeout_s=10) as kv:
                    for i in range(1000):
                        name, count = f"w{worker}-{i}", 512 * (1 + (i + worker) % 2)
                        await kv.spill("acme", name, SPEC, ids[:count], tail=b"",
                                       chunks=chunks[:count // 512], generation=1,
                                       ack="durable")
                        acked[name] = count

            workers = [asyncio.create_task(spiller(w)) for w in range(3)]
            while len(acked) < 12 and not any(w.done() for w in workers):
                await asyncio.sleep(0.01)
            assert len(acked) >= 12, [w.exception() for w in workers if w.done()]
            os.kill(a.pid, signal.SIGKILL)  # mid-spill: others are in flight
            outcomes = await asyncio.gather(*workers, return_exceptions=True)
            assert all(isinstance(o, Exception) for o in outcomes), outcomes
        finally:
            a.stop()
        assert a.proc.returncode == -signal.SIGKILL
        async with AsyncClient(nodes["b"]) as on_b:
            for name, count in sorted(acked.items()):
                got = await on_b.restore("acme", name, want_window=False)
                assert got.token_ids.tolist() == ids[:count].tolist(), name
                assert_persistent(got, chunks[:count // 512], b"")
            # One of them resumed, replaying the window a's death took with it.
            resumed = await on_b.resume("acme", min(acked), replay_tokens=16)
            assert resumed.replayed
            # A spill in flight at the kill is absent or whole, never torn.
            for worker in range(3):
                name = f"w{worker}-{sum(n.startswith(f'w{worker}-') for n in acked)}"
                with contextlib.suppress(SessionNotFound):
                    got = await on_b.restore("acme", name, want_window=False)
                    assert_persistent(got, chunks[:len(got.token_ids) // 512], b"")


async def test_with_a_cluster_master_down_sessions_resume_from_s3(
        tmp_path, fleet_env, redis_cluster_factory, model_state):
    _, ids, chunks, tail, window = model_state
    cluster = redis_cluster_factory(masters=3, node_timeout_ms=1000)
    # A host tier of two sessions: the others' chunks are demoted into the shared Redis.
    small = {**fleet_env, "host_bytes": "700KiB"}
    async with fleet(tmp_path, small, cluster.url, names="ab") as nodes:
        async with AsyncClient(nodes["a"]) as on_a:
            for i in range(6):  # one tenant each: no two share a chunk (dedupe)
                await on_a.spill(f"t{i}", "s1", SPEC, ids, chunks=chunks, tail=tail,
                                 window=window, generation=1, ack="durable")
        held = [node.client().dbsize() for node in cluster.nodes]
        victim = cluster.nodes[held.index(max(held))]
        assert max(held) > 0, held  # the master going down holds some of the chunks
        victim.kill()
        async with AsyncClient(nodes["b"]) as on_b:
            tiers = set()
            for i in range(6):
                got = await on_b.resume(f"t{i}", "s1", replay_tokens=16)
                assert got.replayed  # the window stayed on a
                assert_persistent(got, chunks, tail)
                tiers.add(got.tier)
            assert "object" in tiers, tiers  # served from the bucket


def test_the_advertised_address_is_the_configured_one_or_the_bound_listen_address():
    import socket

    assert ServerConfig(listen="10.0.0.5:0").advertised(4242) == "10.0.0.5:4242"
    assert ServerConfig(listen="0.0.0.0:50051").advertised(50051) == \
        f"{socket.gethostname()}:50051"  # nothing connects to a wildcard
    assert ServerConfig(listen="0.0.0.0:0", advertise_address="kv-1:50051").advertised(7) \
        == "kv-1:50051"
    with pytest.raises(InvalidRequest, match="advertise_address must be HOST:PORT"):
        ServerConfig(advertise_address="kv-1")


async def test_a_single_node_names_itself_as_the_window_node(tmp_path, model_state):
    _, ids, chunks, tail, window = model_state
    config = load_config(preset="test", env={}, overrides={
        "data_dir": tmp_path, "node_id": "solo", "replay": "off"})
    server, port = await create_server(config)
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as kv:
            await kv.spill("acme", "s1", SPEC, ids, chunks=chunks, tail=tail, window=window,
                           generation=1)
            reply = await kv.stat("acme", "s1")
            assert reply.node_id == "solo"
            assert (reply.session.window_node_id, reply.session.window_node_address) == \
                ("solo", f"127.0.0.1:{port}")
            await kv.evict("acme", "s1", "disk")  # the window is dropped: nobody holds it
            assert (await kv.stat("acme", "s1")).session.window_node_id == ""
    finally:
        await server.stop(0.5)
