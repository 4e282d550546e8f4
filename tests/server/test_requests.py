"""Requests an operator can follow: one request id, set by the client, found in the
server's JSON log (the debug line per RPC, the slow-request line with its phases), in the
call's trailers (the exception of a failed call) and on the OpenTelemetry spans the
server exports, to the SDK's in-memory exporter and over OTLP/gRPC to a collector
speaking the real protocol (``opentelemetry.proto``'s TraceService)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvstore.format.errors import InvalidRequest, SessionNotFound
from kvtier import AsyncClient, Client, request_id
from kvtier.request_ids import REQUEST_ID_KEY
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.server.requests import JsonFormatter, RequestFields
from services.server.server import create_server
from services.server.tracing import Tracing
from tests.support.compaction import ROOT
from tests.support.fleet import SPEC, model_state
from tests.support.service import LAYOUT, config_for, streams_for, tokens_for

TOKENS = 3 * LAYOUT.chunk_tokens + 5
__all__ = ["model_state"]  # a fixture, used by name


async def spill_and_restore(address: str) -> None:
    async with AsyncClient(address) as kv:
        with request_id("follow-spill"):
            await kv.spill("acme", "s1", LAYOUT.name, tokens_for(TOKENS),
                           streams_for(LAYOUT, TOKENS), generation=1, ack="durable")
        with request_id("follow-restore"):
            await kv.restore("acme", "s1", want_window=False, decode=False)
        with request_id("follow-missing"), pytest.raises(SessionNotFound) as missing:
            await kv.restore("acme", "nope", want_window=False)
        assert missing.value.request_id == "follow-missing"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: what the exporter sends, as sent."""

    def __init__(self) -> None:
        self.spans = []

    def Export(self, request, context):  # noqa: N802 (the service's name)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def attributes(span) -> dict:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


def test_one_request_id_through_the_json_log_the_trailers_and_an_otlp_span(tmp_path):
    collector = Collector()
    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    config = tmp_path / "kvtier.toml"
    config.write_text(f'otlp_endpoint = "http://127.0.0.1:{port}"\n'
                      "slow_request_s = 0.000001\n")  # every call counts as slow
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "OTEL_"))}
    with open(log_path, "w") as err:
        server = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "--preset", "test", "--config",
             str(config), "--data-dir", str(tmp_path / "data"), "--listen", "127.0.0.1:0",
             "--log-level", "debug", "--log-format", "json"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = server.stdout.readline()
        assert line.startswith("kvtier serving on "), log_path.read_text()[-2000:]
        address = line.split()[3].rstrip(",")
        asyncio.run(spill_and_restore(address))
        with Client(address) as kv, request_id("follow-sync"), \
                pytest.raises(SessionNotFound) as missing:
            kv.restore("acme", "nope", want_window=False)
        assert missing.value.request_id == "follow-sync"
    finally:
        server.terminate()
        server.wait(timeout=60)  # a stop exports the batched spans
        receiver.stop(0)

    lines = [json.loads(text) for text in log_path.read_text().splitlines() if text.strip()]
    assert lines and all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    restore = [x for x in lines if x.get("request_id") == "follow-restore"]
    debug = [x for x in restore if x["message"].startswith("rpc ")]
    assert len(debug) == 1 and debug[0]["level"] == "DEBUG"
    assert debug[0]["tenant"] == "acme" and debug[0]["session"] == "s1"
    assert "method=Restore" in debug[0]["message"] and "code=OK" in debug[0]["message"]
    slow = [x for x in lines if x.get("request_id") == "follow-spill"  # (and its lease call)
            and x["message"].startswith("slow request") and "method=Spill" in x["message"]]
    assert len(slow) == 1 and slow[0]["level"] == "WARNING"
    for field in ("tenant=acme", "session=s1", "tier=", "bytes=", '"receive"', '"store"'):
        assert field in slow[0]["message"], (field, slow[0])
    missing = [x for x in lines if x.get("request_id") == "follow-missing"]
    assert any("code=NOT_FOUND" in x["message"] for x in missing)

    by_id = {span.span_id: span for span in collector.spans}
    restores = [s for s in collector.spans if s.name == "kvtier.Restore"
                and attributes(s).get("kvtier.request_id") == "follow-restore"]
    assert len(restores) == 1
    assert attributes(restores[0])["kvtier.session"] == "s1"
    children = {s.name for s in collector.spans if s.parent_span_id == restores[0].span_id}
    assert "read_send" in children
    spill = next(s for s in collector.spans if s.name == "kvtier.Spill")
    assert attributes(spill)["kvtier.request_id"] == "follow-spill"
    assert {"receive", "store"} <= {s.name for s in collector.spans
                                    if s.parent_span_id == spill.span_id}
    assert all(s.parent_span_id in by_id or not s.parent_span_id for s in collector.spans)


async def test_spans_to_the_in_memory_exporter_and_ids_checked_or_named(tmp_path):
    exporter = InMemorySpanExporter()
    tracing = Tracing(processor=SimpleSpanProcessor(exporter))
    server, port = await create_server(config_for(tmp_path, listen="127.0.0.1:0"),
                                       tracing=tracing)
    address = f"127.0.0.1:{port}"
    try:
        await spill_and_restore(address)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.KVTierStub(channel)
            call = stub.List(pb.ListRequest(tenant="acme"))  # no id sent: the server names one
            await call
            assert re.fullmatch(r"[0-9a-f]{32}", dict(await call.trailing_metadata())[
                REQUEST_ID_KEY])
            for bad in ("a" * 65, "two words", "x=1;y", ""):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.List(pb.ListRequest(tenant="acme"),
                                    metadata=((REQUEST_ID_KEY, bad),))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop(0.5)
    spans = exporter.get_finished_spans()
    restore = next(s for s in spans if s.name == "kvtier.Restore")
    assert restore.attributes["kvtier.request_id"] == "follow-restore"
    assert restore.attributes["kvtier.tenant"] == "acme"
    assert any(s.parent is not None and s.parent.span_id == restore.context.span_id
               for s in spans)
    missing = next(s for s in spans if s.attributes.get("kvtier.request_id") ==
                   "follow-missing")
    assert not missing.status.is_ok
    assert not any(s.name == "kvtier.List" for s in spans)  # only the calls followed


async def test_a_resume_that_replays_has_its_replay_as_a_child_span(tmp_path, model_state):
    weights, ids, chunks, tail, _ = model_state
    exporter = InMemorySpanExporter()
    config = config_for(tmp_path, listen="127.0.0.1:0", replay="in-process",
                        replay_weights=str(weights))
    server, port = await create_server(
        config, tracing=Tracing(processor=SimpleSpanProcessor(exporter)))
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as kv:
            await kv.spill("acme", "s1", SPEC, ids, chunks=chunks, tail=tail, generation=1)
            with request_id("follow-resume"):  # no window was spilled: it is replayed
                resumed = await kv.resume("acme", "s1", replay_tokens=len(ids))
            assert resumed.replayed
    finally:
        await server.stop(0.5)
    spans = exporter.get_finished_spans()
    resume = next(s for s in spans if s.name == "kvtier.Resume")
    assert resume.attributes["kvtier.request_id"] == "follow-resume"
    assert resume.attributes["kvtier.replay_tokens"] == len(ids)
    children = {s.name for s in spans
                if s.parent is not None and s.parent.span_id == resume.context.span_id}
    assert {"read_send", "replay"} <= children


def test_a_client_refuses_a_bad_request_id_and_json_lines_carry_the_request():
    with pytest.raises(InvalidRequest, match="1 to 64 characters"), request_id("not ok"):
        pass
    record = logging.LogRecord("kvtier.test", logging.INFO, __file__, 1, "hello %s",
                               ("world",), None)
    RequestFields().filter(record)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "hello world" and line["level"] == "INFO"
    assert "request_id" not in line  # outside a call
