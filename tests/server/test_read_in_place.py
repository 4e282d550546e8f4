"""ReadChunks ``in_place`` against a real server: chunks the host tier holds are read
where they lie in its shared-memory slabs, pinned under a read lease until the client
releases it or it expires; nothing under a live lease is recycled, and bytes changed in a
slab are a corrupt chunk, never a wrong one."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvstore.format.errors import SharedMemoryExhausted
from kvstore.format.keys import block_key, chunk_digest, dedupe_scope
from kvstore.tiers.arena import ArenaTier
from kvtier import AsyncClient, shm
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.server.shm_leases import LeaseTable
from tests.server.test_prefix_chunks import encoded, keys_of, off_the_host_tier
from tests.support.service import LAYOUT, running_server

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm")


def connect(target: str) -> grpc.aio.Channel:
    """A connection of its own (a peer of its own to the server)."""
    return grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def arena_of(server) -> ArenaTier:
    arena = server.servicer.chunks.arena
    assert isinstance(arena, ArenaTier)
    return arena


def block_keys(tokens, chunks) -> list[str]:
    return [block_key(chain, chunk_digest(chunk))
            for chain, chunk in zip(keys_of(tokens), chunks, strict=True)]


async def settled(predicate) -> None:
    for _ in range(100):  # the release is told on the client's loop, off the caller's path
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not settled")


async def test_host_chunks_are_read_in_place_and_released(tmp_path):
    tokens, chunks, _ = encoded(3)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        metrics, leases = server.servicer.metrics, server.servicer.leases
        copied = metrics.restore_bytes.labels("shm")._value.get()
        with await kv.read_chunks("acme", LAYOUT.name, tokens, in_place=True) as got:
            assert [bytes(got.chunks[i]) for i in range(3)] == chunks
            assert all(got.chunks[i].readonly for i in range(3))
            assert leases.reads == 1 and leases.held_bytes >= sum(map(len, chunks))
            slots = [s for slab in arena_of(server)._slabs.values()
                     for s in slab.taken.values() if not s.removed]
            assert {slot.slab.scope for slot in slots} == {dedupe_scope("acme", None)}
            assert all(slot.pins == 1 for slot in slots)
        await settled(lambda: leases.reads == 0)
        assert all(slot.pins == 0 for slot in slots)
        assert metrics.restore_bytes.labels("shm")._value.get() == copied  # no copy made
        assert metrics.restore_bytes.labels("in_place")._value.get() == sum(map(len, chunks))


@pytest.mark.parametrize("remove", ["delete", "overwrite"])
async def test_a_chunk_removed_under_a_live_read_lease_keeps_its_bytes_until_release(
        tmp_path, remove):
    tokens, chunks, _ = encoded(3)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks, ack="durable")
        arena = arena_of(server)
        got = await kv.read_chunks("acme", LAYOUT.name, tokens, in_place=True)
        keys = block_keys(tokens, chunks)
        for key, chunk in zip(keys, chunks, strict=True):
            if remove == "delete":  # as an eviction or a free would
                await arena.delete(key)
            else:
                await arena.put(key, bytes(len(chunk)))
        for n in range(12):  # same-sized values never take a pinned slot
            await arena.put(f"filler{n}", b"\xff" * len(chunks[0]))
            pinned = arena.pin_many([f"filler{n}"], dedupe_scope("acme", None))[0]
            assert pinned is not None
            arena.unpin(pinned)
        assert [bytes(got.chunks[i]) for i in range(3)] == chunks
        assert arena._lingering and arena._pinned_removed == sum(map(len, chunks))
        got.release()
        await settled(lambda: arena._pinned_removed == 0)
        await settled(lambda: arena._settle() or not arena._lingering)


async def test_a_read_lease_expires_and_frees_what_it_pinned(tmp_path):
    tokens, chunks, _ = encoded(2)
    async with running_server(tmp_path, shm_lease_s=0.2) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks, ack="durable")
        arena, leases = arena_of(server), server.servicer.leases
        got = await kv.read_chunks("acme", LAYOUT.name, tokens, in_place=True)
        for key in block_keys(tokens, chunks):
            await arena.delete(key)
        assert arena.used_bytes == sum(map(len, chunks))  # pinned: still held
        await asyncio.sleep(0.3)
        leases.reap()
        assert leases.reads == 0 and arena.used_bytes == 0 and not arena._lingering
        got.release()  # late: the server ignores a lease it no longer holds


async def test_another_clients_read_lease_is_refused(tmp_path):
    tokens, chunks, _ = encoded(2)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv, \
            connect(target) as mine, connect(target) as theirs:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        stub, other = pb_grpc.KVTierStub(mine), pb_grpc.KVTierStub(theirs)
        request = pb.ReadChunksRequest(tenant="acme", layout_id=LAYOUT.name,
                                       token_ids=tokens.tobytes(), use_shared_memory=True,
                                       refs_in_header=True, in_place=True)
        first = [r async for r in stub.ReadChunks(request)][0].header
        assert first.read_lease and len(first.arena_slabs) == 1
        refused = await other.ReleaseSegments(pb.ReleaseRequest(lease_ids=[first.read_lease]))
        assert refused.released == 0 and server.servicer.leases.reads == 1
        released = await stub.ReleaseSegments(pb.ReleaseRequest(lease_ids=[first.read_lease]))
        assert released.released == 1 and server.servicer.leases.reads == 0


async def test_past_a_lease_bound_chunks_come_through_the_reply_path(tmp_path):
    tokens, chunks, _ = encoded(3)
    bound = len(chunks[0])  # not even one chunk's pin fits
    async with running_server(tmp_path, shm_lease_bytes_per_client=bound) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        with await kv.read_chunks("acme", LAYOUT.name, tokens, in_place=True) as got:
            assert [bytes(got.chunks[i]) for i in range(3)] == chunks
        assert server.servicer.leases.reads == 0
        assert all(slot.pins == 0 for slab in arena_of(server)._slabs.values()
                   for slot in slab.taken.values())


def test_read_leases_are_bounded_as_segment_leases_are():
    table = LeaseTable(60, per_client_bytes=1000, total_bytes=1500)
    arena = ArenaTier(1 << 20)
    asyncio.run(arena.put("a", b"x" * 800))
    asyncio.run(arena.put("b", b"y" * 800))
    slot_a, slot_b = arena.pin_many(["a", "b"], "s")
    assert slot_a is not None and slot_b is not None
    table.pin_reads("peer-1", [slot_a], arena.unpin)
    with pytest.raises(SharedMemoryExhausted, match="shm_lease_bytes_per_client"):
        table.pin_reads("peer-1", [slot_b], arena.unpin)
    with pytest.raises(SharedMemoryExhausted, match="shm_lease_bytes_total"):
        table.pin_reads("peer-2", [slot_b], arena.unpin)
    table.close()
    assert slot_a.pins == 0
    asyncio.run(arena.close())


async def test_bytes_changed_in_a_slab_are_a_corrupt_chunk_never_a_wrong_one(tmp_path):
    tokens, chunks, _ = encoded(3)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        for _ in range(2):  # moved into acme's slabs, then proven there: read unhashed
            with await kv.read_chunks("acme", LAYOUT.name, tokens, in_place=True):
                pass
        arena = arena_of(server)
        slot = arena.pin_many([block_keys(tokens, chunks)[1]], dedupe_scope("acme", None))[0]
        assert slot is not None
        slot.arr[len(chunks[1]) // 2] ^= 0xFF  # the slab's memory, behind the tier
        arena.unpin(slot)
        with await kv.read_chunks("acme", LAYOUT.name, tokens, in_place=True) as got:
            assert got.missing == {1: "corrupt"}
            assert [bytes(got.chunks[i]) for i in (0, 2)] == [chunks[0], chunks[2]]


async def test_chunks_below_the_host_tier_come_in_the_same_reply(tmp_path):
    tokens, chunks, _ = encoded(4)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks, ack="durable")
        await off_the_host_tier(server, tokens, chunks[2:], first=2)
        with await kv.read_chunks("acme", LAYOUT.name, tokens, in_place=True) as got:
            assert [bytes(got.chunks[i]) for i in range(4)] == chunks
            assert server.servicer.leases.reads == 1


async def test_the_client_unmaps_slabs_the_server_stops_naming(tmp_path):
    tokens, chunks, _ = encoded(1)
    theirs, their_chunks, _ = encoded(1, seed=3)
    async with running_server(tmp_path, shm_lease_s=0.2) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        await kv.write_chunks("beta", LAYOUT.name, theirs, their_chunks)
        with await kv.read_chunks("acme", LAYOUT.name, tokens, in_place=True):
            pass
        segments = kv._router.nodes[0].segments
        acme_slabs = set(segments._slabs)
        assert len(acme_slabs) == 1
        await asyncio.sleep(0.3)
        with await kv.read_chunks("beta", LAYOUT.name, theirs, in_place=True) as got:
            assert bytes(got.chunks[0]) == their_chunks[0]
        assert set(segments._slabs).isdisjoint(acme_slabs)  # acme's not named for a while
        assert len(segments._slabs) == 1  # beta's: each tenant's chunks in slabs of its own


async def test_the_client_unmaps_a_slab_the_server_removed(tmp_path):
    tokens, chunks, _ = encoded(1)
    theirs, their_chunks, _ = encoded(1, seed=3)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks, ack="durable")
        await kv.write_chunks("acme", LAYOUT.name, theirs, their_chunks, ack="durable")
        with await kv.read_chunks("acme", LAYOUT.name, tokens, in_place=True):
            pass
        segments = kv._router.nodes[0].segments
        [gone] = segments._slabs
        arena = arena_of(server)
        await arena.delete(block_keys(tokens, chunks)[0])  # its slab's only value
        await settled(lambda: arena._settle() or not arena._lingering)
        with await kv.read_chunks("acme", LAYOUT.name, theirs, in_place=True) as got:
            assert bytes(got.chunks[0]) == their_chunks[0]
        assert gone not in segments._slabs  # its memory is not kept alive here
