"""The one error table over real gRPC on loopback: every ``KVTierError`` class comes back
to the kvtier client (and to the replay clients) as the very class the server raised, with
the status code the table gives it; an error that is not ours becomes INTERNAL and the
server goes on serving."""

from __future__ import annotations

import grpc
import pytest

import kvtier
from kvstore.format import errors
from kvstore.format import registry as layout_registry
from kvstore.format.errors import (
    ERROR_CLASSES,
    ERROR_KEY,
    KVTierError,
    ServerError,
    SessionNotFound,
)
from kvstore.format.presets import SHIPPED
from kvtier import AsyncClient, RetryPolicy
from kvtier import errors as kvtier_errors
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.replay.remote import RemoteReplay
from services.replay.streams import error_reply, parse_reply
from services.serving import errors as server_errors
from services.serving.errors import grpc_errors, status_for
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for

NO_RETRY = RetryPolicy(attempts=1)


def _all_subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_all_subclasses(sub)}
    return found


# Every class of the hierarchy, the root included (a bare KVTierError can be raised too).
CLASSES = sorted({KVTierError, *_all_subclasses(KVTierError)}, key=lambda c: c.__name__)


class RaisingKVTier(pb_grpc.KVTierServicer):
    """List raises the error class its tenant names: one table entry per call."""

    @grpc_errors
    async def List(self, request: pb.ListRequest, context: grpc.aio.ServicerContext
                   ) -> pb.ListReply:
        raise ERROR_CLASSES[request.tenant].from_message(f"raised {request.tenant}")


class RaisingReplay(pb_grpc.ReplayServicer):
    @grpc_errors
    async def Rebuild(self, request: pb.ReplayRequest, context: grpc.aio.ServicerContext
                      ) -> pb.ReplayReply:
        raise ERROR_CLASSES[request.layout_id].from_message(f"raised {request.layout_id}")


async def _serve(add, servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_the_table_covers_every_class_and_kvtier_exports_it():
    assert {cls.__name__ for cls in CLASSES} == set(ERROR_CLASSES)
    for cls in CLASSES:
        assert getattr(kvtier, cls.__name__) is cls
        assert getattr(kvtier_errors, cls.__name__) is cls
    assert kvtier_errors.ERROR_KEY == ERROR_KEY == "kvtier-error"
    # A few entries spelled out, so the table is checked and not only consistent.
    expected = {"InvalidRequest": "INVALID_ARGUMENT", "SharedMemoryUnavailable":
                "INVALID_ARGUMENT", "SessionNotFound": "NOT_FOUND",
                "ChunksNotHeld": "NOT_FOUND", "TierFull": "RESOURCE_EXHAUSTED",
                "MessageTooLarge": "RESOURCE_EXHAUSTED",
                "StaleGeneration": "FAILED_PRECONDITION", "MissingChunks":
                "FAILED_PRECONDITION", "ReplayUnavailable": "FAILED_PRECONDITION",
                "ChunkTruncated": "DATA_LOSS", "DataLoss": "DATA_LOSS",
                "TierUnavailable": "UNAVAILABLE", "Busy": "ABORTED",
                "ServerError": "INTERNAL", "KVTierError": "INTERNAL"}
    for name, code in expected.items():
        assert errors.status_name(ERROR_CLASSES[name].from_message("x")) == code, name
    assert errors.status_name(RuntimeError("not ours")) == "INTERNAL"
    # Without a class name the code alone decides.
    assert type(errors.error_for("NOT_FOUND", "gone")) is SessionNotFound
    assert type(errors.error_for("UNIMPLEMENTED", "no such rpc")) is ServerError


async def test_every_error_class_round_trips_to_the_client():
    server, addr = await _serve(pb_grpc.add_KVTierServicer_to_server, RaisingKVTier())
    try:
        async with grpc.aio.insecure_channel(addr) as channel, \
                AsyncClient(addr, retry=NO_RETRY) as kv:
            stub = pb_grpc.KVTierStub(channel)
            for cls in CLASSES:
                with pytest.raises(grpc.aio.AioRpcError) as raw:
                    await stub.List(pb.ListRequest(tenant=cls.__name__))
                assert raw.value.code() == status_for(cls.from_message("x")), cls
                assert dict(raw.value.trailing_metadata())[ERROR_KEY] == cls.__name__
                with pytest.raises(KVTierError, match=f"raised {cls.__name__}") as info:
                    await kv.list(cls.__name__)
                assert type(info.value) is cls
    finally:
        await server.stop(0)


async def test_replay_clients_raise_the_workers_class():
    server, addr = await _serve(pb_grpc.add_ReplayServicer_to_server, RaisingReplay())
    backend = RemoteReplay([addr], timeout_s=10)
    try:
        for cls in CLASSES:
            if issubclass(cls, errors.TierUnavailable):  # UNAVAILABLE: the next worker is tried
                continue
            with pytest.raises(KVTierError, match=f"replay worker: raised {cls.__name__}"
                               ) as info:
                await backend.rebuild(cls.__name__, [1, 2, 3], [], b"")
            assert type(info.value) is cls
            # Redis Streams replay carries the same names through a reply list.
            with pytest.raises(KVTierError) as info:
                parse_reply(error_reply(cls.from_message("x")))
            assert type(info.value) is cls
    finally:
        await backend.close()
        await server.stop(0)
    with pytest.raises(errors.TierUnavailable, match="no replay worker answered"):
        parse_reply(error_reply(errors.TierUnavailable("no replay worker answered")))


async def test_an_unexpected_error_is_internal_and_the_server_keeps_serving(tmp_path):
    # Weights that are not a checkpoint: the in-process replay backend fails with the
    # loader's own exception (not a KVTierError) when a Resume first needs it.
    weights = tmp_path / "broken.safetensors"
    weights.write_bytes(b"not a safetensors file")
    tokens = tokens_for(LAYOUT.chunk_tokens + 40)
    async with running_server(tmp_path, replay="in-process", replay_weights=str(weights)
                              ) as (server, addr), \
            AsyncClient(addr, retry=NO_RETRY) as kv, \
            grpc.aio.insecure_channel(addr) as channel:
        await kv.spill("acme", "s1", LAYOUT.name, tokens, streams_for(LAYOUT, len(tokens)),
                       generation=1)
        stub = pb_grpc.KVTierStub(channel)
        request = pb.ResumeRequest(session=pb.SessionRef(tenant="acme", session_id="s1"))
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            async for _ in stub.Resume(request):
                pass
        assert raw.value.code() == grpc.StatusCode.INTERNAL
        assert dict(raw.value.trailing_metadata())[ERROR_KEY] == "ServerError"
        # The next calls are served: the same failure again, and the others as before.
        with pytest.raises(ServerError):
            await kv.resume("acme", "s1")
        assert (await kv.stat("acme", "s1")).session.num_tokens == len(tokens)
        restored = await kv.restore("acme", "s1")
        assert restored.token_ids.tolist() == tokens.tolist() and restored.replay_needed
        errors_total = server.metrics.registry.get_sample_value
        assert errors_total("kvtier_requests_total",
                            {"method": "Resume", "code": "INTERNAL"}) == 2


async def test_resume_refuses_an_oversize_replay_before_reading_the_session(tmp_path):
    # The session does not exist: INVALID_ARGUMENT, not NOT_FOUND, shows the check came
    # first (services.server.validate), before the store was asked.
    request = pb.ResumeRequest(session=pb.SessionRef(tenant="acme", session_id="nobody"),
                               replay_tokens=1 << 20)
    async with running_server(tmp_path) as (_, addr), grpc.aio.insecure_channel(addr) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            async for _ in pb_grpc.KVTierStub(ch).Resume(request):
                pass
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "replay_tokens" in raw.value.details()


async def test_a_long_client_value_comes_back_short_and_invalid_argument(tmp_path,
                                                                       monkeypatch):
    # 20 kB echoed whole overflowed gRPC's metadata limit: RESOURCE_EXHAUSTED, not ours.
    # An unknown layout's refusal lists the known ones: only the shipped presets here, not
    # whatever layouts tests run before this one registered in the process.
    monkeypatch.setattr(layout_registry, "_REGISTRY", {spec.name: spec for spec in SHIPPED})
    long_id, long_layout = "x" * 20_000, "y" * 20_000
    ref = pb.SessionRef(tenant="acme", session_id=long_id)
    async with running_server(tmp_path) as (_, addr), grpc.aio.insecure_channel(addr) as ch:
        stub = pb_grpc.KVTierStub(ch)

        def spill(header: pb.SpillHeader):
            return stub.Spill(iter([pb.SpillRequest(header=header)]))

        calls = [
            lambda: stub.Stat(pb.StatRequest(session=ref)),
            lambda: stub.Delete(pb.DeleteRequest(session=ref)),
            lambda: stub.List(pb.ListRequest(tenant=long_id)),
            lambda: stub.Evict(pb.EvictRequest(session=pb.SessionRef(
                tenant="acme", session_id="s1"), target_tier=long_id)),
            lambda: stub.Restore(pb.RestoreRequest(session=ref)),
            lambda: spill(pb.SpillHeader(session=ref, layout_id=LAYOUT.name)),
            lambda: spill(pb.SpillHeader(session=pb.SessionRef(tenant="acme", session_id="s1"),
                                         layout_id=long_layout)),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as raw:
                result = call()
                if hasattr(result, "__aiter__"):
                    async for _ in result:
                        pass
                else:
                    await result
            assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raw.value.details()
            assert len(raw.value.details()) < 600, raw.value.details()
            assert "(20000 long)" in raw.value.details()


def test_client_messages_hold_no_server_paths_and_fit_the_metadata_limit():
    shown = server_errors.client_message
    message = ("disk tier /var/lib/kvtier/disk: reading failed: [Errno 5] I/O error: "
               "'/var/lib/kvtier/disk/segments/000007.seg' (acme/s1, s3://bucket/a/b, ../x)")
    assert shown(message) == ("disk tier <path>: reading failed: [Errno 5] I/O error: "
                              "'<path>' (acme/s1, s3://bucket/a/b, ../x)")
    assert shown("a / b and 1/2") == "a / b and 1/2"
    long = shown("é" * 50_000)
    assert len(long.encode()) <= server_errors.MAX_DETAILS_BYTES and long.endswith("B)")
    assert errors.shown("z" * 1000) == repr("z" * 128) + "... (1000 long)"
    assert errors.shown("short") == "'short'"
