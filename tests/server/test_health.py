"""Health checking, reflection, the Prometheus endpoint, and the operator tools
(``kvtier stat``, ``top``, ``list``) against a real loopback server."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvtier import AsyncClient
from services import cli
from services.server.address_file import recorded_address
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for

TOKENS = LAYOUT.chunk_tokens + 20
V1_REFLECTION = "grpc.reflection.v1.ServerReflection"


async def test_health_and_reflection(tmp_path):
    async with running_server(tmp_path, reflection=True) as (_, target), \
            grpc.aio.insecure_channel(target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "kvtier.v1.KVTier"):
            reply = await check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name async for r in stream for s in r.list_services_response.service}
        assert {"kvtier.v1.KVTier", "grpc.health.v1.Health", V1_REFLECTION} <= names
        # grpc.reflection.v1 (what current grpcurl asks first): the same messages on the
        # wire under another service name; it can describe the KVTier service.
        v1 = channel.stream_stream(
            f"/{V1_REFLECTION}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        replies = [r async for r in v1(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvtier.v1.KVTier"),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=V1_REFLECTION)]))]
        assert V1_REFLECTION in {s.name for s in replies[0].list_services_response.service}
        for reply in replies[1:]:
            assert reply.WhichOneof("message_response") == "file_descriptor_response"
            assert reply.file_descriptor_response.file_descriptor_proto


async def test_health_command_exits_by_the_serving_status(tmp_path, capsys):
    async with running_server(tmp_path) as (_, target):
        health = lambda *argv: asyncio.to_thread(  # noqa: E731
            cli.main, ["health", "--server", target, *argv])
        assert await health() == 0
        assert await health("--service", "kvtier.v1.KVTier") == 0
        assert "SERVING" in capsys.readouterr().out
        assert await health("--service", "no.such.Service") == 1
        assert "NOT_FOUND" in capsys.readouterr().out
    assert await asyncio.to_thread(
        cli.main, ["health", "--server", target, "--timeout", "1"]) == 1  # stopped


async def test_server_records_a_connectable_address_while_serving(tmp_path):
    async with running_server(tmp_path, listen="0.0.0.0:0") as (server, _):
        address = recorded_address(tmp_path)
        assert address == f"127.0.0.1:{server.port}"  # a wildcard is not dialable
        assert [p.name for p in tmp_path.iterdir() if "server.addr" in p.name] == [
            "server.addr"]  # no temporary file left behind
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvtier.v1.KVTier"))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert recorded_address(tmp_path) is None  # removed on stop
    async with running_server(tmp_path) as (server, target):
        assert recorded_address(tmp_path) == target


async def test_metrics_endpoint_counts_lookups_and_hits_per_tier(tmp_path):
    tokens = tokens_for(TOKENS)
    async with running_server(tmp_path, metrics_port=0) as (server, target), \
            AsyncClient(target) as kv:
        port = server.start_metrics(0, "127.0.0.1")
        await kv.spill("acme", "s1", LAYOUT.name, tokens, streams_for(LAYOUT, TOKENS),
                       generation=1)
        await kv.restore("acme", "s1")
        await kv.evict("acme", "s1", "disk")
        await kv.restore("acme", "s1")
        await kv.stat()  # refreshes the snapshot the endpoint exports
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line.startswith("kvtier_")}
    assert samples['kvtier_tier_hits_total{tier="host"}'] == 1
    assert samples['kvtier_tier_hits_total{tier="disk"}'] == 1
    assert samples['kvtier_tier_lookups_total{tier="host"}'] == 2
    assert samples['kvtier_tier_lookups_total{tier="disk"}'] == 1
    assert samples['kvtier_evictions_total{tier="host"}'] >= 1
    # The first restore read host, the second (after the evict) disk.
    assert samples['kvtier_restore_seconds_count{tier="host"}'] == 1
    assert samples['kvtier_restore_seconds_count{tier="disk"}'] == 1
    assert samples["kvtier_spill_seconds_count"] == 1
    assert samples['kvtier_requests_total{code="OK",method="Restore"}'] == 2
    assert samples['kvtier_request_seconds_count{method="Spill"}'] == 1
    assert samples['kvtier_tier_up{tier="disk"}'] == 1
    assert samples['kvtier_tier_read_bytes_total{tier="disk"}'] > 0
    assert "kvtier_writeback_queue_depth" in samples
    assert samples['kvtier_tier_used_bytes{tier="disk"}'] > 0


async def test_stat_top_and_list_tools(tmp_path, capsys):
    tokens = tokens_for(TOKENS)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "s1", LAYOUT.name, tokens, streams_for(LAYOUT, TOKENS),
                       generation=7)
        await kv.restore("acme", "s1")
        run = lambda *argv: asyncio.to_thread(cli.main, [*argv, "--server", target])  # noqa: E731
        assert await run("stat", "--session", "acme/s1") == 0
        out = capsys.readouterr().out
        assert "host" in out and "100.0%" in out and "generation 7" in out
        assert await run("stat", "--json") == 0
        assert json.loads(capsys.readouterr().out)["sessions"] == 1  # a number, not "1"
        assert await run("top", "--iterations", "2", "--interval", "0.05") == 0
        assert capsys.readouterr().out.count("kvtier top") == 2
        assert await run("list", "--tenant", "acme") == 0
        assert "acme/s1" in capsys.readouterr().out
        assert await run("list", "--json") == 0
        assert json.loads(capsys.readouterr().out)["generation"] == 7
        assert await asyncio.to_thread(cli.main, ["stat", "--server", "127.0.0.1:1"]) == 1
