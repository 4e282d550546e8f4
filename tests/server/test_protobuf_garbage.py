"""Bytes that do not parse as a request, sent raw over a real channel to every method of
the kvtier server and of the replay worker: INVALID_ARGUMENT naming the request type (not
gRPC's UNKNOWN, nor INTERNAL from inside a client stream), no ERROR in the server's log,
and the server goes on serving."""

from __future__ import annotations

import logging

import grpc
import pytest

from kvstore.format.errors import ERROR_KEY
from proto import kvtier_pb2 as pb
from replay.worker import ReplayWorker
from services.replay.server import create_server as create_replay_server
from tests.support.replay import tiny_model
from tests.support.service import running_server

# A length-delimited field that runs past the end, a varint longer than ten bytes, and
# wire type 7 (which does not exist): each fails to parse as any message.
GARBAGE = [b"\x0a\x05ab", b"\x08" + b"\xff" * 11, b"\x0f"]
KVTIER = pb.DESCRIPTOR.services_by_name["KVTier"]
REPLAY = pb.DESCRIPTOR.services_by_name["Replay"]


async def _send_raw(channel: grpc.aio.Channel, method, raw: bytes) -> grpc.aio.AioRpcError:
    """Call ``method`` with ``raw`` as its (only) request message, bytes as they are."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if method.client_streaming:
            await channel.stream_unary(path)(iter([raw]))
        elif method.server_streaming:
            async for _ in channel.unary_stream(path)(raw):
                pass
        else:
            await channel.unary_unary(path)(raw)
    return info.value


async def _assert_refused(channel, method, raw) -> None:
    error = await _send_raw(channel, method, raw)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method.name, error)
    assert f"not a valid {method.input_type.full_name}" in error.details(), method.name
    assert dict(error.trailing_metadata())[ERROR_KEY] == "InvalidRequest"


async def test_every_kvtier_method_refuses_undecodable_bytes(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    async with running_server(tmp_path) as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        for method in KVTIER.methods:
            for raw in GARBAGE:
                await _assert_refused(channel, method, raw)
        # Garbage after a valid first message of a client stream too.
        spill = KVTIER.methods_by_name["Spill"]
        first = pb.SpillRequest(header=pb.SpillHeader()).SerializeToString()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await channel.stream_unary("/kvtier.v1.KVTier/Spill")(iter([first, GARBAGE[0]]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Still serving, each refusal counted by its method.
        reply = await channel.unary_unary("/kvtier.v1.KVTier/Stat")(b"")
        assert pb.StatReply.FromString(reply).sessions == 0
        count = server.metrics.registry.get_sample_value
        assert count("kvtier_requests_total",
                     {"method": "Stat", "code": "INVALID_ARGUMENT"}) == len(GARBAGE)
        assert count("kvtier_requests_total",
                     {"method": spill.name, "code": "INVALID_ARGUMENT"}) == len(GARBAGE) + 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_the_replay_worker_refuses_undecodable_bytes(caplog):
    caplog.set_level(logging.WARNING)
    worker = ReplayWorker(tiny_model())
    server, port = await create_replay_server("127.0.0.1:0", worker)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method in REPLAY.methods:
                for raw in GARBAGE:
                    await _assert_refused(channel, method, raw)
    finally:
        await server.stop(0.5)
        await worker.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
