"""``kvtier stat --fleet`` on real fleet servers over moto's S3 server: the sessions the
shared bucket holds (what ``kvtier list`` shows on any node, where ``sessions`` counts
those this node has loaded), the nodes seen, each node's liveness (heartbeats), the gc
epoch and the node's CAS outcomes; ``--json`` numbers as numbers."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from kvtier import AsyncClient, InvalidRequest
from services.cli.main import main
from services.server.config_load import load_config
from services.server.server import create_server
from tests.support.fleet import fleet_servers
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for

TOKENS = LAYOUT.chunk_tokens + 20


@pytest.fixture
def node(tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    return lambda name: load_config(preset="test", env={}, overrides={
        "data_dir": tmp_path / name, "metadata": "shared", "node_id": name, "replay": "off",
        "s3_endpoint": s3_server, "s3_bucket": s3_bucket, "listen": "127.0.0.1:0",
        "s3_region": s3_credentials["region_name"]})


async def spill(target: str, tenant: str, names: list[str]) -> None:
    async with AsyncClient(target) as kv:
        for i, name in enumerate(names):
            await kv.spill(tenant, name, LAYOUT.name, tokens_for(TOKENS, seed=i),
                           streams_for(LAYOUT, TOKENS, seed=i), generation=1, ack="durable")


def stat(capsys, *argv: str) -> dict:
    assert main(["stat", *argv]) == 0
    return json.loads(capsys.readouterr().out)


async def test_stat_fleet_counts_the_shared_sessions_every_node_lists(node, capsys):
    async with fleet_servers(node, "ab") as addresses:
        a, b = addresses["a"], addresses["b"]
        await spill(a, "acme", ["a1", "a2"])
        await spill(b, "acme", ["b1", "b2"])
        await spill(b, "beta", ["b3"])
        async with AsyncClient(a) as kv:
            listed = await kv.list()
            await kv.restore("acme", "b1")  # a reads a manifest b wrote
        plain = await asyncio.to_thread(stat, capsys, "--server", a, "--json")
        assert "fleet" not in plain
        got = await asyncio.to_thread(stat, capsys, "--server", a, "--json", "--fleet")
        assert {key: got[key] for key in plain if key != "tiers"} == \
            {key: plain[key] for key in plain if key != "tiers"}  # the same keys, and more
        fleet = got["fleet"]
        assert int(fleet["sessions"]) == len(listed) == 5  # every node's sessions
        assert int(got["sessions"]) == 2  # what a itself stores
        assert fleet["nodesSeen"] == ["a", "b"]
        assert fleet["gcState"] == "done" and int(fleet["gcEpoch"]) == 0
        assert {k: int(v) for k, v in fleet["cas"].items()} == {"won": 2, "conflict": 0,
                                                                "error": 0}
        assert await asyncio.to_thread(main, ["stat", "--server", b, "--fleet"]) == 0
        text = capsys.readouterr().out
        assert "fleet: sessions 5" in text and "won 3" in text


async def test_stat_fleet_on_a_single_node_is_refused(tmp_path, capsys):
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        with pytest.raises(InvalidRequest, match="not a fleet node"):
            await kv.stat(fleet=True)


async def test_stat_fleet_numbers_are_json_numbers(node, capsys):
    async with fleet_servers(node, "a") as addresses:
        await spill(addresses["a"], "acme", ["a1"])
        got = await asyncio.to_thread(stat, capsys, "--server", addresses["a"], "--json",
                                      "--fleet", "--tenant", "acme")
    assert got["sessions"] == 1 and got["fleet"]["sessions"] == 1  # not "1"
    assert got["fleet"]["cas"] == {"won": 1, "conflict": 0, "error": 0}
    assert all(isinstance(t["usedBytes"], int) and isinstance(t["capacityBytes"], int)
               for t in got["tiers"])
    assert got["tenantUsage"]["sessions"] == 1


async def test_stat_fleet_shows_each_node_alive_stopped_or_down(node, capsys):
    """Heartbeats every 0.1 s, down after 1 s: a running node is serving, one stopped
    cleanly says stopped (not down), one that stops beating (killed, hung) is down."""
    beating = {"fleet_heartbeat_s": 0.1, "fleet_down_after_s": 1.0}
    servers = {}
    try:
        for name in "abc":
            servers[name], _ = await create_server(
                dataclasses.replace(node(name), **beating))
        a = servers["a"].address
        await servers["b"].stop(0.2)  # its last heartbeat says stopped
        # c's heartbeats stop as a killed node's would (its task cancelled, no last word)
        servers["c"].fleet_node._task.cancel()
        await asyncio.sleep(1.5)
        got = await asyncio.to_thread(stat, capsys, "--server", a, "--json", "--fleet")
        nodes = {n["nodeId"]: n for n in got["fleet"]["nodes"]}
        assert set(nodes) == {"a", "b", "c"}
        assert nodes["a"]["state"] == "serving" and not nodes["a"]["down"]
        assert nodes["a"]["heartbeatAgeS"] < 1.0 and nodes["a"]["address"] == a
        assert nodes["b"]["state"] == "stopped" and not nodes["b"]["down"]
        assert nodes["c"]["down"] and nodes["c"]["heartbeatAgeS"] > 1.0
        assert await asyncio.to_thread(main, ["stat", "--server", a, "--fleet"]) == 0
        text = capsys.readouterr().out
        assert [line.split()[0] for line in text.splitlines() if line.endswith("DOWN")] == ["c"]
        metrics = servers["a"].metrics.registry.get_sample_value("kvtier_fleet_nodes_down")
        assert metrics == 1.0
    finally:
        for server in servers.values():
            await server.stop(0.2)
