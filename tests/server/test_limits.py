"""The server's bounds on what clients hold open (``services.server.limits``), over real
gRPC: streams per connection and in all, a Spill stream that goes silent, and the bytes of
uncommitted spills per tenant and in all. Past each bound: RESOURCE_EXHAUSTED naming the
config key; within them the server answers, and its memory stays within a budget."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.format.keys import chain_keys, chunk_digest, dedupe_scope
from kvtier.codec import as_tokens, encode_session
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
RSS_BUDGET = 128 * MiB  # growth of the server's RSS with 300 idle Spill streams open
HEADER_TOKENS = 65_536  # 256 KiB of token ids per header: 300 unbounded take ~240 MiB
WAIT_S = 60  # a generous bound on waiting for the server, never asserted


def _header(tenant: str, session_id: str, tokens: np.ndarray, digests: list[bytes],
            tail: bytes = b"") -> pb.SpillRequest:
    keys = chain_keys(LAYOUT.layout_id, tokens, LAYOUT.chunk_tokens, scope=dedupe_scope(tenant))
    return pb.SpillRequest(header=pb.SpillHeader(
        session=pb.SessionRef(tenant=tenant, session_id=session_id), layout_id=LAYOUT.name,
        generation=1, token_ids=tokens.tobytes(), chunk_keys=keys, chunk_digests=digests,
        tail_digest=chunk_digest(tail) if tail else b""))


async def _header_then_silence(message: pb.SpillRequest):
    yield message
    await asyncio.Event().wait()  # never sends more: cancelled with the call


async def _silence():
    await asyncio.Event().wait()
    yield pb.SpillRequest()  # never reached: a stream that sends nothing at all


def _open_idle(stub, messages) -> list[grpc.aio.StreamUnaryCall]:
    return [stub.Spill(_header_then_silence(m)) for m in messages]


async def _until_ended(calls, count: int) -> list[grpc.aio.StreamUnaryCall]:
    """Wait until ``count`` of ``calls`` have ended; those."""
    async with asyncio.timeout(WAIT_S):
        while sum(call.done() for call in calls) < count:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # any further (wrong) refusal shows up too
    return [call for call in calls if call.done()]


async def _refusal(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    return info.value.details()


def _session(seed: int = 0):
    tokens = as_tokens(tokens_for(LAYOUT.chunk_tokens + 40, seed))
    return tokens, encode_session(LAYOUT, tokens, streams_for(LAYOUT, len(tokens)),
                                  scope=dedupe_scope("acme"))


def _full_spill(tenant: str, session_id: str, tokens, enc):
    header = _header(tenant, session_id, tokens, enc.digests, enc.tail)
    yield header
    yield pb.SpillRequest(chunk=pb.Payload(key=header.header.chunk_keys[0], data=enc.chunks[0]))
    yield pb.SpillRequest(tail=pb.Payload(data=enc.tail))


SERVER = """
import asyncio, json, sys
from services.server.config_load import load_config
from services.server.server import create_server

async def main():
    config = load_config(preset="test", env={}, overrides=json.loads(sys.argv[1]))
    server, port = await create_server(config)
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0.5)

asyncio.run(main())
"""


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_300_idle_spill_streams_stay_within_the_bounds_and_the_budget(tmp_path):
    overrides = {"data_dir": str(tmp_path), "max_streams": 50, "max_peer_streams": 20}
    server = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(overrides)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    channels = []
    try:
        target = f"127.0.0.1:{int(server.stdout.readline())}"
        # Three connections (a distinct channel argument stops gRPC from sharing one).
        channels = [grpc.aio.insecure_channel(target, options=[("kvtier.test.connection", i)])
                    for i in range(3)]
        stubs = [pb_grpc.KVTierStub(channel) for channel in channels]
        for stub in stubs:
            await stub.Stat(pb.StatRequest())
        before = _rss(server.pid)
        tokens = np.random.default_rng(0).integers(0, LAYOUT.vocab_size, HEADER_TOKENS,
                                                   dtype="<u4")
        digests = [bytes(32)] * (len(tokens) // LAYOUT.chunk_tokens)  # never sent: idle
        calls, refusals = [], []
        # 100 streams a connection, one connection after another: 20 of the first two
        # stay open (max_peer_streams), 10 of the third (max_streams = 50 in all).
        for index, (stub, held) in enumerate(zip(stubs, (20, 20, 10), strict=True)):
            opened = _open_idle(stub, [_header("acme", f"s{index}-{i}", tokens, digests)
                                       for i in range(100)])
            calls += opened
            refusals += [await _refusal(call) for call in await _until_ended(opened,
                                                                             100 - held)]
        assert len(refusals) == 250
        assert sum("(max_peer_streams = 20)" in r for r in refusals) == 160
        assert sum("(max_streams = 50)" in r for r in refusals) == 90
        # The 50 open streams hold their slots; the server answers beside them.
        reply = await stubs[0].Stat(pb.StatRequest())
        assert reply.sessions == 0
        grown = _rss(server.pid) - before
        assert grown < RSS_BUDGET, f"the server's RSS grew by {grown / MiB:.0f} MiB"
        for call in calls:
            call.cancel()
        # Slots come back when streams end: a new stream is let in again.
        tokens, enc = _session()
        await _until_ended(calls, len(calls))
        # the server learns of the cancellations after the client: its slots come back soon
        deadline = time.monotonic() + 30
        while True:
            try:
                reply = await stubs[0].Spill(_full_spill("acme", "after", tokens, enc))
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or \
                        time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        assert reply.generation == 1
    finally:
        for channel in channels:
            await channel.close()
        server.stdin.close()
        server.wait(WAIT_S)


async def test_a_silent_spill_stream_is_cancelled_naming_the_timeout(tmp_path):
    tokens, enc = _session()
    async with running_server(tmp_path, stream_idle_s=0.2) as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        header_only = stub.Spill(_header_then_silence(_header("acme", "s1", tokens,
                                                              enc.digests)))
        nothing = stub.Spill(_silence())
        for call in (header_only, nothing):
            details = await _refusal(call)
            assert "sent nothing" in details and "stream_idle_s = 0.2" in details
        limits = server.servicer.limits
        assert (limits.streams, limits.inflight_bytes) == (0, 0)
        # A stream that keeps sending is not cut off.
        assert (await stub.Spill(_full_spill("acme", "s1", tokens, enc))).generation == 1


async def test_restore_and_resume_streams_count_against_the_connection(tmp_path):
    tokens, enc = _session()
    async with running_server(tmp_path, max_peer_streams=1) as (_, target), \
            grpc.aio.insecure_channel(target) as channel, \
            grpc.aio.insecure_channel(target, options=[("kvtier.test.connection", 1)]) as other:
        stub, other_stub = pb_grpc.KVTierStub(channel), pb_grpc.KVTierStub(other)
        idle = _open_idle(stub, [_header("acme", "s1", tokens, enc.digests)])[0]
        ref = pb.SessionRef(tenant="acme", session_id="nobody")
        await asyncio.sleep(0.1)  # the idle stream has its slot
        for call in (stub.Restore(pb.RestoreRequest(session=ref)),
                     stub.Resume(pb.ResumeRequest(session=ref))):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "(max_peer_streams = 1)" in info.value.details()
        # Another connection has its own slots: past the bound, to the store.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in other_stub.Restore(pb.RestoreRequest(session=ref)):
                pass
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        idle.cancel()


async def test_uncommitted_spill_bytes_are_bounded_per_tenant_and_in_all(tmp_path):
    tokens, enc = _session()
    header = _header("acme", "idle", tokens, enc.digests, enc.tail)
    spill_bytes = header.ByteSize() + len(enc.chunks[0]) + len(enc.tail)
    # A tenant has room for one whole spill and half a header: not for a spill beside an
    # idle header; the server for a spill beside one idle header, not beside two.
    bound, total = spill_bytes + header.ByteSize() // 2, spill_bytes + 3 * header.ByteSize() // 2
    async with running_server(tmp_path, max_tenant_inflight_bytes=bound,
                              max_inflight_bytes=total) as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        limits = server.servicer.limits
        idle = _open_idle(stub, [header])[0]
        async with asyncio.timeout(WAIT_S):
            while limits.inflight_bytes < header.ByteSize():
                await asyncio.sleep(0.01)
        details = await _refusal(stub.Spill(_full_spill("acme", "s1", tokens, enc)))
        assert f"(max_tenant_inflight_bytes = {bound})" in details
        # Another tenant has its own allowance, until the total is reached.
        reply = await stub.Spill(_full_spill("other", "s1", tokens, enc))
        assert reply.generation == 1
        other_idle = _open_idle(stub, [_header("other", "idle", tokens, enc.digests, enc.tail)])[0]
        async with asyncio.timeout(WAIT_S):
            while limits.inflight_bytes < 2 * header.ByteSize():
                await asyncio.sleep(0.01)
        details = await _refusal(stub.Spill(_full_spill("third", "s1", tokens, enc)))
        assert f"(max_inflight_bytes = {total})" in details
        # Bytes are released when their call ends: the refused spill now goes through.
        idle.cancel()
        other_idle.cancel()
        async with asyncio.timeout(WAIT_S):
            while limits.inflight_bytes:
                await asyncio.sleep(0.01)
        assert (await stub.Spill(_full_spill("acme", "s1", tokens, enc))).generation == 1
        assert limits.tenant_bytes == {} and limits.inflight_bytes == 0
