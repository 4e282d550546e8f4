"""Shared memory is the server's: a client names no file, holds only leases, and the
bytes leased are bounded per client and in all; leases end at their lease time and at
shutdown. Every attack here ran against the client-named design."""

from __future__ import annotations

import os
import secrets
import stat

import grpc
import pytest

from kvstore.format.errors import SharedMemoryExhausted, TierFull
from kvstore.format.keys import dedupe_scope
from kvtier import AsyncClient, shm
from kvtier.codec import as_tokens, encode_session
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.server.shm_leases import LeaseTable
from stress.adversarial.cases import planted
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    raw_spill_header,
    running_server,
    streams_for,
    tokens_for,
)

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs a writable /dev/shm")

TOKENS = 2 * LAYOUT.chunk_tokens + 36
REF = pb.SessionRef(tenant="acme", session_id="s1")
MiB = 1 << 20
# Paths and names a client might try instead of a lease id.
PATH_LIKE = (".", "..", "/", "../..", "/dev/shm", "../../etc/passwd", "kvtier-x/../..")


def connect(target: str) -> grpc.aio.Channel:
    """A connection of its own: channels of one process otherwise share one, and a
    connection (its peer address) is what the server calls a client."""
    return grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _old_reply_buffer(name: str) -> bytes:
    """Field 5 as the client-named design sent it: SharedMemoryRef{name, 0, 1 MiB}."""
    ref = bytes([0x0A, len(name)]) + name.encode() + bytes([0x18]) + b"\x80\x80\x40"
    return bytes([0x2A, len(ref)]) + ref


async def _spill_inline(target: str, session: str = "s1") -> dict:
    persistent = streams_for(LAYOUT, TOKENS)
    async with AsyncClient(target, shared_memory=False) as kv:
        await kv.spill("acme", session, LAYOUT.name, tokens_for(TOKENS), persistent,
                       generation=1)
    return persistent


async def _drain(call) -> list[pb.RestoreReply]:
    return [reply async for reply in call]


async def _status(awaitable) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    return info.value.code(), info.value.details()


def _restore(**fields) -> pb.RestoreRequest:
    return pb.RestoreRequest(session=REF, use_shared_memory=True, **fields)


async def test_a_restore_cannot_write_into_a_file_a_client_names(tmp_path):
    secret = secrets.token_bytes(22_293)
    async with running_server(tmp_path) as (server, target), \
            connect(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        await _spill_inline(target)
        with planted(secret, 0o400) as victim:
            for name in (victim.name, str(victim), f"../shm/{victim.name}"):
                code, details = await _status(_drain(stub.Restore(_restore(reply_lease=name))))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, details)
                assert "not held by this client" in details
            # The old field naming the victim is no longer read: the restore succeeds,
            # into a segment of the server's own.
            request = _restore()
            request.MergeFromString(_old_reply_buffer(victim.name))
            replies = await _drain(stub.Restore(request))
            assert replies[0].header.reply_segment.name != victim.name
            assert victim.read_bytes() == secret
            assert stat.S_IMODE(victim.stat().st_mode) == 0o400
        assert len(server.servicer.leases) == 1


async def test_a_spill_cannot_read_a_planted_file(tmp_path):
    tokens = as_tokens(tokens_for(TOKENS))
    enc = encode_session(LAYOUT, tokens, streams_for(LAYOUT, TOKENS),
                         scope=dedupe_scope(REF.tenant))
    header = raw_spill_header(REF, tokens, enc)

    def spill(ref: pb.SharedMemoryRef):
        async def messages():
            yield pb.SpillRequest(header=header)
            yield pb.SpillRequest(chunk=pb.Payload(key=enc.keys[0], shm=ref))
            for i in range(1, len(enc.keys)):
                yield pb.SpillRequest(chunk=pb.Payload(key=enc.keys[i], data=enc.chunks[i]))
            yield pb.SpillRequest(tail=pb.Payload(data=enc.tail))
        return messages()

    # The planted bytes are a valid chunk 0: were they read, the spill would verify.
    async with running_server(tmp_path) as (_, target), \
            connect(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        with planted(bytes(enc.chunks[0]), 0o600) as plant:
            length = len(enc.chunks[0])
            for lease_id in (plant.name, str(plant), "", *PATH_LIKE):
                ref = pb.SharedMemoryRef(lease_id=lease_id, offset=0, length=length)
                code, details = await _status(stub.Spill(spill(ref)))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (lease_id, details)
                assert "not held by this client" in details
            old = pb.SharedMemoryRef(offset=0, length=length)
            old.MergeFromString(bytes([0x0A, len(plant.name)]) + plant.name.encode())
            code, _ = await _status(stub.Spill(spill(old)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert not (await stub.List(pb.ListRequest())).sessions
        code, _ = await _status(_drain(stub.Restore(_restore())))
        assert code == grpc.StatusCode.NOT_FOUND  # the planted bytes never come back


async def test_path_like_lease_ids_are_invalid_argument_not_internal(tmp_path):
    async with running_server(tmp_path) as (server, target), \
            connect(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        await _spill_inline(target)
        for lease_id in PATH_LIKE:
            for call in (stub.Restore(_restore(reply_lease=lease_id)),
                         stub.Resume(pb.ResumeRequest(session=REF, use_shared_memory=True,
                                                      reply_lease=lease_id))):
                code, details = await _status(_drain(call))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (lease_id, details)
        errors = server.metrics.registry.get_sample_value
        assert not errors("kvtier_requests_total", {"method": "Restore", "code": "INTERNAL"})


async def test_a_lease_is_its_clients_alone(tmp_path):
    async with running_server(tmp_path) as (_, target), \
            connect(target) as mine, \
            connect(target) as other:
        await _spill_inline(target)
        lease = await pb_grpc.KVTierStub(mine).LeaseSegment(pb.LeaseRequest(size=4096))
        stub = pb_grpc.KVTierStub(other)
        code, details = await _status(_drain(stub.Restore(_restore(reply_lease=lease.lease_id))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not held by" in details
        assert (await stub.ReleaseSegments(pb.ReleaseRequest(lease_ids=[lease.lease_id]))
                ).released == 0
        # Still the owner's: it restores into it, then releases it.
        mine_stub = pb_grpc.KVTierStub(mine)
        replies = await _drain(mine_stub.Restore(_restore(reply_lease=lease.lease_id)))
        assert replies[0].header.reply_segment.lease_id == lease.lease_id
        assert (await mine_stub.ReleaseSegments(pb.ReleaseRequest(lease_ids=[lease.lease_id]))
                ).released == 1
        assert not (shm.SHM_DIR / lease.name).exists()


async def test_a_ref_beyond_the_leased_segment_is_refused(tmp_path):
    async with running_server(tmp_path) as (_, target), \
            connect(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        lease = await stub.LeaseSegment(pb.LeaseRequest(size=4096))

        async def messages():
            yield pb.SpillRequest(header=pb.SpillHeader(
                session=REF, layout_id=LAYOUT.name, generation=1,
                token_ids=as_tokens(tokens_for(4)).tobytes()))
            yield pb.SpillRequest(tail=pb.Payload(shm=pb.SharedMemoryRef(
                lease_id=lease.lease_id, offset=lease.size - 10, length=20)))

        code, details = await _status(stub.Spill(messages()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "beyond" in details


async def test_unmapped_restores_stop_at_the_per_client_and_total_bounds(tmp_path):
    per_client, total = 4 * MiB, 6 * MiB
    async with running_server(tmp_path, shm_lease_bytes_per_client=per_client,
                              shm_lease_bytes_total=total) as (server, target), \
            connect(target) as first, \
            connect(target) as second:
        leases = server.servicer.leases
        persistent = await _spill_inline(target)
        for channel, room in ((first, per_client), (second, total - per_client)):
            stub = pb_grpc.KVTierStub(channel)
            for i in range(10):  # each restore leases a segment, none is ever mapped
                header, *rest = await _drain(stub.Restore(_restore()))
                leased = header.header.HasField("reply_segment")
                assert leased == (i < room // MiB), i
                bodies = {r.chunk.payload.WhichOneof("body") for r in rest
                          if r.WhichOneof("item") == "chunk"}
                assert bodies == {"shm" if leased else "data"}
                assert leases.held_bytes <= total
        assert leases.held_bytes == total
        for channel, bound in ((first, "shm_lease_bytes_per_client"),
                               (second, "shm_lease_bytes_total")):
            code, details = await _status(
                pb_grpc.KVTierStub(channel).LeaseSegment(pb.LeaseRequest(size=1)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and bound in details
        # The Python client, refused on both paths, falls back to inline bytes unasked.
        async with AsyncClient(target) as kv:
            assert kv.shared_memory
            await kv.spill("acme", "s2", LAYOUT.name, tokens_for(TOKENS), persistent,
                           generation=1)
            assert_streams_equal((await kv.restore("acme", "s2")).persistent, persistent)
            assert kv.shared_memory
        assert leases.held_bytes == total


async def test_server_segments_are_0600_and_reaped_at_lease_end_and_shutdown(tmp_path):
    clock = Clock()
    async with running_server(tmp_path, shm_lease_s=30.0) as (server, target), \
            connect(target) as channel:
        leases = server.servicer.leases
        leases.clock = clock
        stub = pb_grpc.KVTierStub(channel)
        await _spill_inline(target)
        header = (await _drain(stub.Restore(_restore())))[0].header
        segment = shm.SHM_DIR / header.reply_segment.name
        info = segment.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
        assert header.reply_segment.lease_s == 30.0
        clock.now += 29.0
        assert leases.reap() == 0 and segment.exists()  # still the client's to map
        clock.now += 1.0
        kept = await stub.LeaseSegment(pb.LeaseRequest(size=1))  # leasing reaps first
        assert not segment.exists() and len(leases) == 1
        code, details = await _status(_drain(stub.Restore(
            _restore(reply_lease=header.reply_segment.lease_id))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "shm_lease_s" in details
        clock.now += 29.0  # a use renews the lease
        await _drain(stub.Restore(_restore(reply_lease=kept.lease_id)))
        clock.now += 29.0
        assert leases.reap() == 0
    assert not (shm.SHM_DIR / kept.name).exists()  # unlinked at shutdown


def test_the_lease_table_rounds_bounds_and_releases():
    clock = Clock()
    table = LeaseTable(lease_s=10.0, per_client_bytes=3 * MiB, total_bytes=4 * MiB,
                       clock=clock)
    try:
        a = table.create("peer-a", 1)
        assert a.size == MiB and table.held_bytes == MiB
        # its own error, not TierFull: no tier is full, the bytes go inline
        with pytest.raises(SharedMemoryExhausted, match="shm_lease_bytes_per_client") as refused:
            table.create("peer-a", 3 * MiB)
        assert not isinstance(refused.value, TierFull)
        b = table.create("peer-b", 3 * MiB)
        with pytest.raises(SharedMemoryExhausted, match="shm_lease_bytes_total"):
            table.create("peer-a", 1)
        assert table.release("peer-a", [b.lease_id, "nothing"]) == 0  # not a's to end
        busy = table.reply_segment("peer-b", b.lease_id, 100)
        assert busy is b
        assert table.release("peer-b", [b.lease_id]) == 1
        assert (shm.SHM_DIR / b.name).exists()  # being written: unlinked when done
        table.done(b)
        assert not (shm.SHM_DIR / b.name).exists()
        clock.now += 10.0
        assert table.reap() == 1 and not len(table)
        assert not (shm.SHM_DIR / a.name).exists()
    finally:
        table.close()
