"""A drain moves a node's windows to a live peer (``AdoptWindow``, role ``peer``), on a
fleet of two ``kvtier serve`` children over one moto bucket and one real redis-server:
the peer resumes each session as it was (no replay, the same bytes); a tenant token may
not call the peer RPC; a window whose digest, length or bytes do not hold is refused and
nothing adopted; with the peer killed the windows are released as before, and with the
peer a router would pick killed the next live one takes them; a peer that refuses the
drained node's credential leaves them released."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
from pathlib import Path

import grpc
import pytest

from kvstore.fleet.liveness import NodeLiveness
from kvstore.format.checks import window_bytes_max
from kvstore.format.keys import chunk_digest
from kvtier import AsyncClient
from kvtier.channel import Credentials, open_channel
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.cli.main import main
from services.server.devcerts import tokens_toml
from services.server.peers import peer_order
from testing.live_server import Child
from tests.support.fleet import SPEC, TOKENS, assert_persistent

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = 2


def serve(tmp_path: Path, shared: dict, redis_url: str, name: str, **extra: str) -> Child:
    """A ``kvtier serve`` child named ``name`` (not started), replay off: a resume that
    needed a replay would fail, so one that answers held its window."""
    values = {**shared, "redis_url": redis_url, "node_id": name, "preset": "test",
              "data_dir": str(tmp_path / name), "listen": "127.0.0.1:0", "replay": "off",
              **extra}
    config = tmp_path / f"{name}.toml"
    config.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items()))
    return Child([sys.executable, "-m", "services.cli", "serve", "--config", str(config),
                  "--log-level", "WARNING"], "kvtier serving on ", tmp_path / f"{name}.log",
                 {"PYTHONPATH": str(ROOT)})


def adopt_call(target: str, token: str, header: pb.AdoptWindowHeader, window: bytes):
    """One AdoptWindow on ``target`` with ``token``: (reply or None, status code)."""

    async def call():
        async def messages():
            yield pb.AdoptWindowRequest(header=header)
            yield pb.AdoptWindowRequest(window=window)

        async with open_channel(target, Credentials(token=token)) as channel:
            try:
                reply = await pb_grpc.KVTierStub(channel).AdoptWindow(messages(), timeout=20)
            except grpc.aio.AioRpcError as exc:
                return None, exc.code(), exc.details()
            return reply, grpc.StatusCode.OK, ""

    return call()


@pytest.fixture
def tokens(tmp_path) -> dict[str, str]:
    """Tokens by role (admin, tenant acme, peer), their tokens file and token files."""
    made = {"admin": secrets.token_urlsafe(16), "acme": secrets.token_urlsafe(16),
            "peer": secrets.token_urlsafe(16)}
    (tmp_path / "tokens.toml").write_text(tokens_toml({
        made["admin"]: ("", "admin"), made["acme"]: ("acme", "tenant"),
        made["peer"]: ("", "peer")}))
    for name, token in made.items():
        (tmp_path / f"{name}.token").write_text(token + "\n")
    return made


async def test_a_drain_moves_windows_to_the_peer_which_resumes_them_without_replay(
        tmp_path, fleet_env, redis_server, model_state, tokens, capsys):
    _, ids, chunks, tail, window = model_state
    auth = {"auth_tokens_file": str(tmp_path / "tokens.toml"),
            "peer_token_file": str(tmp_path / "peer.token")}
    a = serve(tmp_path, fleet_env, redis_server, "a", **auth)
    b = serve(tmp_path, fleet_env, redis_server, "b", **auth)
    try:
        on_a_at, on_b_at = await asyncio.gather(asyncio.to_thread(a.start),
                                                asyncio.to_thread(b.start))
        async with AsyncClient(on_a_at, token=tokens["acme"]) as on_a:
            for i in range(SESSIONS):
                spilled = await on_a.spill("acme", f"s{i}", SPEC, ids, chunks=chunks,
                                           tail=tail, window=window, generation=1,
                                           ack="memory")
                assert spilled.window_kept

        header = pb.AdoptWindowHeader(
            session=pb.SessionRef(tenant="acme", session_id="s0"), generation=1,
            from_node="a", window_digest=chunk_digest(window), window_bytes=len(window))
        # a tenant may not hand windows to a node, even its own session's
        _, code, _ = await adopt_call(on_b_at, tokens["acme"], header, window)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # a peer's window whose bytes are not the ones the digest names: DATA_LOSS
        flipped = window[:-1] + bytes([window[-1] ^ 1])
        _, code, details = await adopt_call(on_b_at, tokens["peer"], header, flipped)
        assert code == grpc.StatusCode.DATA_LOSS and "digest" in details
        # a length past the layout's bound is refused on the header
        big = pb.AdoptWindowHeader()
        big.CopyFrom(header)
        big.window_bytes = window_bytes_max(SPEC) + 1
        _, code, details = await adopt_call(on_b_at, tokens["peer"], big, window)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "window_bytes" in details
        # garbled bytes under their own digest: not a window of the session
        garbled = bytes(16) + window[16:]
        bad = pb.AdoptWindowHeader()
        bad.CopyFrom(header)
        bad.window_digest = chunk_digest(garbled)
        _, code, _ = await adopt_call(on_b_at, tokens["peer"], bad, garbled)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        # a generation the session is not at: the session moved on, left alone
        old = pb.AdoptWindowHeader()
        old.CopyFrom(header)
        old.generation = 2
        _, code, _ = await adopt_call(on_b_at, tokens["peer"], old, window)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        async with AsyncClient(on_b_at, token=tokens["acme"]) as on_b:
            assert (await on_b.stat("acme", "s0")).session.window_node_id == "a"  # none took

        assert await asyncio.to_thread(main, [
            "drain", "--server", on_a_at, "--json", "--interval", "0.2",
            "--token-file", str(tmp_path / "admin.token")]) == 0
        last = json.loads(capsys.readouterr().out)
        assert last["done"] and last["windowsMoved"] == SESSIONS
        assert last["windowsReleased"] == 0 and last["windowsHeld"] == 0
        os.kill(a.pid, signal.SIGKILL)  # nothing of a is needed any more

        async with AsyncClient(on_b_at, token=tokens["acme"]) as on_b:
            for i in range(SESSIONS):
                assert (await on_b.stat("acme", f"s{i}")).session.window_node_id == "b"
                got = await on_b.resume("acme", f"s{i}", replay_tokens=TOKENS)
                assert not got.replayed and got.replay_tokens == 0
                assert_persistent(got, chunks, tail)
                assert bytes(got.window_blob) == window
    finally:
        a.stop()
        b.stop()


async def test_with_the_peer_killed_the_windows_are_released_as_before(
        tmp_path, fleet_env, redis_server, model_state, capsys):
    _, ids, chunks, tail, window = model_state
    a = serve(tmp_path, fleet_env, redis_server, "a")
    b = serve(tmp_path, fleet_env, redis_server, "b")
    try:
        on_a_at, _ = await asyncio.gather(asyncio.to_thread(a.start),
                                          asyncio.to_thread(b.start))
        async with AsyncClient(on_a_at) as on_a:
            for i in range(SESSIONS):
                await on_a.spill("acme", f"s{i}", SPEC, ids, chunks=chunks, tail=tail,
                                 window=window, generation=1, ack="memory")
        # b's heartbeat still says serving: the drain tries it, finds it gone, releases
        os.kill(b.pid, signal.SIGKILL)
        assert await asyncio.to_thread(main, ["drain", "--server", on_a_at, "--json",
                                              "--interval", "0.2"]) == 0
        last = json.loads(capsys.readouterr().out)
        assert last["done"] and last["windowsMoved"] == 0
        assert last["windowsReleased"] == SESSIONS
        async with AsyncClient(on_a_at) as on_a:
            for i in range(SESSIONS):
                assert (await on_a.stat("acme", f"s{i}")).session.window_node_id == ""
                got = await on_a.restore("acme", f"s{i}", want_window=False)
                assert_persistent(got, chunks, tail)
    finally:
        a.stop()
        b.stop()


async def test_a_window_whose_chosen_peer_is_gone_moves_to_the_next_live_one(
        tmp_path, fleet_env, redis_server, model_state, capsys):
    _, ids, chunks, tail, window = model_state
    sessions = [f"s{i}" for i in range(4)]
    # b and c are the peers, sorted by id; at least one session's first choice is b
    firsts = [peer_order([_peer("b"), _peer("c")], "acme", sid)[0].node_id
              for sid in sessions]
    assert "b" in firsts
    a, b, c = (serve(tmp_path, fleet_env, redis_server, name) for name in "abc")
    try:
        on_a_at, _, on_c_at = await asyncio.gather(*(asyncio.to_thread(node.start)
                                                     for node in (a, b, c)))
        async with AsyncClient(on_a_at) as on_a:
            for sid in sessions:
                await on_a.spill("acme", sid, SPEC, ids, chunks=chunks, tail=tail,
                                 window=window, generation=1, ack="memory")
        os.kill(b.pid, signal.SIGKILL)  # its heartbeat still says serving
        assert await asyncio.to_thread(main, ["drain", "--server", on_a_at, "--json",
                                              "--interval", "0.2"]) == 0
        last = json.loads(capsys.readouterr().out)
        assert last["windowsMoved"] == len(sessions) and last["windowsReleased"] == 0
        async with AsyncClient(on_c_at) as on_c:
            for sid in sessions:
                assert (await on_c.stat("acme", sid)).session.window_node_id == "c"
                got = await on_c.resume("acme", sid)
                assert not got.replayed and bytes(got.window_blob) == window
    finally:
        for node in (a, b, c):
            node.stop()


def _peer(name: str) -> NodeLiveness:
    return NodeLiveness(name, f"{name}:1", "serving", 0.0, False)


async def test_a_drain_without_a_peer_credential_releases_the_windows(
        tmp_path, fleet_env, redis_server, model_state, tokens, capsys):
    _, ids, chunks, tail, window = model_state
    auth = {"auth_tokens_file": str(tmp_path / "tokens.toml")}  # no peer_token_file
    a = serve(tmp_path, fleet_env, redis_server, "a", **auth)
    b = serve(tmp_path, fleet_env, redis_server, "b", **auth)
    try:
        on_a_at, on_b_at = await asyncio.gather(asyncio.to_thread(a.start),
                                                asyncio.to_thread(b.start))
        async with AsyncClient(on_a_at, token=tokens["acme"]) as on_a:
            for i in range(SESSIONS):
                await on_a.spill("acme", f"s{i}", SPEC, ids, chunks=chunks, tail=tail,
                                 window=window, generation=1, ack="memory")
        assert await asyncio.to_thread(main, [
            "drain", "--server", on_a_at, "--json", "--interval", "0.2",
            "--token-file", str(tmp_path / "admin.token")]) == 0
        last = json.loads(capsys.readouterr().out)
        assert last["windowsMoved"] == 0 and last["windowsReleased"] == SESSIONS
        async with AsyncClient(on_b_at, token=tokens["acme"]) as on_b:
            for i in range(SESSIONS):  # b refused a's call: no window named anywhere
                assert (await on_b.stat("acme", f"s{i}")).session.window_node_id == ""
    finally:
        a.stop()
        b.stop()
