"""The replay worker over gRPC on loopback: ``services.replay.remote`` calls it, errors keep their
class, a dead worker is skipped, a layout the worker never registered replays from the
JSON the request carries, and a kvtier server configured with the worker resumes a
session whose window was dropped through it."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.format.errors import InvalidRequest, LayoutMismatch, TierUnavailable, UnknownLayout
from kvstore.format.layout import BaselineKV, layout_to_json
from kvstore.format.registry import get_layout
from kvtier.client import AsyncClient
from model.infer import replay
from replay.state_codec import encode_window, state_from_chunks, state_to_chunks
from replay.worker import ReplayWorker
from services.replay.messages import replay_request
from services.replay.remote import RemoteReplay
from services.replay.server import create_server
from tests.support.replay import TINY_SPEC, tiny_model, tiny_session
from tests.support.servers import free_port
from tests.support.service import running_server


@pytest.fixture(scope="module")
def model():
    return tiny_model()


async def test_remote_backend_rebuilds_through_a_worker(model, opened):
    state, chunks, tail = tiny_session(model, 45)
    worker = ReplayWorker(model, default_tokens=16)
    server, port = await create_server("127.0.0.1:0", worker, name="w1")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    backend = RemoteReplay([dead, f"127.0.0.1:{port}"], timeout_s=10)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvtier.v1.Replay"))
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        for _ in range(2):  # whichever worker's turn it is, the live one answers
            result = await backend.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail)
            assert result.replayed_tokens == 16
            assert result.window == encode_window(TINY_SPEC,
                                                  replay(model, state.without_window(), 16))
            assert backend.last_worker == "w1"
        # Concurrent calls each reach the live worker despite the dead one, and the batch
        # sizes of the calls queued behind one another come back over gRPC.
        together = await asyncio.gather(*(backend.rebuild(TINY_SPEC.layout_id, state.token_ids,
                                                          chunks, tail) for _ in range(6)))
        assert max(r.batch_size for r in together) > 1
        with pytest.raises(InvalidRequest, match="replay_tokens"):
            await backend.rebuild(TINY_SPEC, state.token_ids, chunks, tail, 100_000)
        with pytest.raises(LayoutMismatch):
            await backend.rebuild("kvtier-bundled", state.token_ids, chunks, tail)
    finally:
        await backend.close()
        await server.stop(0)
        await worker.close()
    only_dead = opened.adopt(RemoteReplay([dead], timeout_s=2))
    with pytest.raises(TierUnavailable, match="no replay worker answered"):
        await only_dead.rebuild(TINY_SPEC.layout_id, state.token_ids, chunks, tail)
    await opened.close(only_dead)


async def test_server_resume_replays_a_dropped_window_on_the_worker(model, tmp_path):
    state, _, _ = tiny_session(model, 45)
    chunks, tail, window = state_to_chunks(TINY_SPEC, state)
    worker = ReplayWorker(model)
    replay_server, port = await create_server("127.0.0.1:0", worker)
    try:
        async with (running_server(tmp_path, replay_workers=f"127.0.0.1:{port}") as (_, addr),
                    AsyncClient(addr) as kv):
            await kv.spill("t", "s1", TINY_SPEC.layout_id, state.token_ids,
                           chunks=[c for _, c in chunks], tail=tail, window=window,
                           generation=1)
            warm = await kv.resume("t", "s1", decode=False)
            assert not warm.replayed and bytes(warm.window_blob) == window
            assert (await kv.evict("t", "s1", "disk")).window_dropped
            cold = await kv.resume("t", "s1", decode=False, replay_tokens=20)
            assert cold.replayed and cold.replay_tokens == 20
            ready = state_from_chunks(model.cfg, cold.token_ids, cold.chunks, cold.tail,
                                      cold.window_blob, spec=TINY_SPEC)
            expected = replay(model, state.without_window(), 20)
            assert bytes(cold.window_blob) == encode_window(TINY_SPEC, expected)
            assert ready.window_len == expected.window_len
    finally:
        await replay_server.stop(0)
        await worker.close()


async def test_a_layout_only_the_server_registered_replays_from_its_json(model):
    # An engine's own name and baseline for the tiny model's cache: a new id, the same
    # bytes. This process never registers it, as a worker elsewhere would not have.
    spec = replace(TINY_SPEC, name="engine-tiny", baseline=BaselineKV(2, 2, 16))
    with pytest.raises(UnknownLayout):
        get_layout(spec.layout_id)
    state, _, _ = tiny_session(model, 45)
    encoded, tail, _ = state_to_chunks(spec, state)
    chunks = [c for _, c in encoded]
    worker = ReplayWorker(model, default_tokens=16)
    server, port = await create_server("127.0.0.1:0", worker)
    backend = RemoteReplay([f"127.0.0.1:{port}"], timeout_s=10)
    try:
        result = await backend.rebuild(spec, state.token_ids, chunks, tail)  # JSON sent
        assert result.window == encode_window(spec, replay(model, state.without_window(), 16))
        with pytest.raises(UnknownLayout):  # by id alone the worker cannot know it
            await backend.rebuild(spec.layout_id, state.token_ids, chunks, tail)
        forged = replay_request(spec, state.token_ids, chunks, tail, None)
        forged.layout_id = TINY_SPEC.layout_id
        with pytest.raises(InvalidRequest, match="layout_json is layout engine-tiny@"):
            await backend.send(forged)
        huge = replay_request(spec, state.token_ids, chunks, tail, None)
        huge.layout_json = layout_to_json(replace(spec, chunk_tokens=1 << 20))
        huge.layout_id = ""
        with pytest.raises(InvalidRequest, match="chunk_tokens"):  # RegisterLayout's bounds
            await backend.send(huge)
        # a layout this model cannot rebuild: LayoutMismatch, which a kvtier server
        # answers as ReplayUnavailable (FAILED_PRECONDITION)
        with pytest.raises(LayoutMismatch):
            await backend.rebuild(replace(spec, chunk_tokens=32), state.token_ids, chunks, tail)
    finally:
        await backend.close()
        await server.stop(0)
        await worker.close()


def test_worker_without_weights_exits_with_a_clear_message(tmp_path, capsys):
    from services import cli

    assert cli.main(["replay-worker", "--weights", str(tmp_path / "none.safetensors"),
                     "--listen", "127.0.0.1:0"]) == 2
    assert "no weights at" in capsys.readouterr().err


async def test_sighup_reloads_the_workers_tokens_and_keeps_serving(model, tmp_path):
    """A rotated tokens file is taken on SIGHUP (the old token refused, the new one let
    through); a file that does not parse leaves the running tokens in force."""
    import hashlib
    import os
    import signal
    import subprocess
    import sys

    from model.checkpoint import save
    from proto import kvtier_pb2 as pb
    from proto import kvtier_pb2_grpc as pb_grpc
    from tests.support.service import ROOT

    def tokens_file(token: str) -> str:
        digest = hashlib.sha256(token.encode()).hexdigest()
        return f'[[token]]\nsha256 = "{digest}"\ntenant = ""\nrole = "replay"\n'

    tokens = tmp_path / "tokens.toml"
    tokens.write_text(tokens_file("first-replay-token"))
    weights = tmp_path / "tiny.safetensors"
    save(model, weights)
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "replay-worker", "--listen", "127.0.0.1:0",
         "--weights", str(weights), "--auth-tokens-file", str(tokens),
         "--log-level", "WARNING"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = await asyncio.to_thread(process.stdout.readline)
        assert "serving on" in line, (line, process.stderr.read() if process.poll() else "")
        target = line.split("serving on ")[1].split(",")[0].strip()

        async def code(token: str) -> grpc.StatusCode:
            """The status of an empty Rebuild: past authentication it is refused as
            INVALID_ARGUMENT, before it as UNAUTHENTICATED."""
            async with grpc.aio.insecure_channel(target) as channel:
                try:
                    await pb_grpc.ReplayStub(channel).Rebuild(
                        pb.ReplayRequest(), timeout=10,
                        metadata=(("authorization", f"Bearer {token}"),))
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
            return grpc.StatusCode.OK

        async def after_sighup(token: str, want: grpc.StatusCode) -> grpc.StatusCode:
            got = None
            for _ in range(100):  # the signal is handled on the worker's loop
                got = await code(token)
                if got == want:
                    break
                await asyncio.sleep(0.05)
            return got

        assert await code("first-replay-token") == grpc.StatusCode.INVALID_ARGUMENT
        assert await code("second-replay-token") == grpc.StatusCode.UNAUTHENTICATED
        tokens.write_text(tokens_file("second-replay-token"))
        process.send_signal(signal.SIGHUP)
        assert await after_sighup("second-replay-token", grpc.StatusCode.INVALID_ARGUMENT) \
            == grpc.StatusCode.INVALID_ARGUMENT
        assert await code("first-replay-token") == grpc.StatusCode.UNAUTHENTICATED
        tokens.write_text("[[token]\nnot toml")
        process.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.5)
        assert process.poll() is None, "SIGHUP ended the worker"
        assert await code("second-replay-token") == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "reload refused" in err and "second-replay-token" not in err
