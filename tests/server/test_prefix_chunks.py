"""WriteChunks and ReadChunks over a real server: prefix chunks of no session, stored as
retained cache of the caller's domain and read by their position in a token sequence."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from kvstore.format.checks import chunk_bytes_max
from kvstore.format.chunk import StreamData
from kvstore.format.errors import (
    InvalidRequest,
    PermissionDenied,
    PreconditionFailed,
    QuotaExceeded,
)
from kvstore.format.keys import block_key, chain_keys, chunk_digest, dedupe_scope
from kvtier import AsyncClient, shm
from kvtier import codec as cc
from kvtier.prefix_chunks import checked_result
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from tests.support.service import (
    LAYOUT,
    ROOT,
    assert_streams_equal,
    running_server,
    streams_for,
    tokens_for,
)
from tests.vectors.generate import wire_layout

C = LAYOUT.chunk_tokens


def encoded(count: int, seed: int = 0, *, first: int = 0) -> tuple:
    """(tokens, chunks from ``first`` on, the streams of all ``count`` chunks)."""
    tokens = cc.as_tokens(tokens_for(count * C, seed=seed))
    full = streams_for(LAYOUT, count * C, seed=seed)
    chunks = cc.encode_chunks(LAYOUT, tokens, full)
    if first:  # the helper encodes a range from streams over that range alone
        ranged = {s.name: StreamData(
            full[s.name].codes[:, first * C // s.tokens_per_entry:],
            full[s.name].scales[:, first * C // s.tokens_per_entry:])
            for s in LAYOUT.persistent_streams}
        assert cc.encode_chunks(LAYOUT, tokens, ranged, first_chunk=first) == chunks[first:]
    return tokens, chunks, full


def keys_of(tokens, tenant: str = "acme", domain: str | None = None) -> list[str]:
    return chain_keys(LAYOUT.layout_id, tokens, C, scope=dedupe_scope(tenant, domain))


async def off_the_host_tier(server, tokens, chunks, first: int = 0) -> None:
    """Drop ``chunks`` (of ``tokens``, from chunk ``first``), written durably, from the
    host tier (as an eviction would): a read then finds them on disk."""
    host, stack = server.manager.tiers[0], server.manager.store.stack
    for chain, chunk in zip(keys_of(tokens)[first:], chunks, strict=True):
        key = block_key(chain, chunk_digest(chunk))
        await host.delete(key)
        stack._forget(0, key)


async def test_round_trip_by_position_with_first_chunk_and_max_chunks(tmp_path):
    tokens, chunks, full = encoded(6)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        written = await kv.write_chunks("acme", LAYOUT.name, tokens[:4 * C], chunks[:4])
        assert (written.chunks_written, written.chunks_deduped) == (4, 0)
        assert written.chunk_keys == keys_of(tokens)[:4] and written.tier == "host"
        # extend the prefix: keys still chain from token 0
        more = await kv.write_chunks("acme", LAYOUT.name, tokens, chunks[4:], first_chunk=4)
        assert more.chunk_keys == keys_of(tokens)[4:] and more.chunks_written == 2
        got = await kv.read_chunks("acme", LAYOUT.name, tokens)
        assert got.keys == keys_of(tokens) and not got.missing
        assert [bytes(got.chunks[i]) for i in range(6)] == chunks
        assert_streams_equal(cc.decode_persistent(LAYOUT, tokens, [got.chunks[i] for i in
                                                                   range(6)], b""), full)
        part = await kv.read_chunks("acme", LAYOUT.name, tokens, first_chunk=2, max_chunks=3)
        assert part.first_chunk == 2 and sorted(part.chunks) == [2, 3, 4]
        assert part.keys == keys_of(tokens)[2:5]
        # a longer sequence than is held: the chunks past it are missing, not an error
        longer, _, _ = encoded(7)
        past = await kv.read_chunks("acme", LAYOUT.name, longer[:6 * C].tolist()
                                    + tokens_for(C, seed=9).tolist(), first_chunk=5)
        assert past.missing == {6: "not_held"} and sorted(past.chunks) == [5]
        stat = await kv.stat(usage_of="acme")
        assert stat.retained_chunks == 6
        assert stat.tenant_usage.retained_bytes == sum(map(len, chunks))
        assert stat.tenant_usage.durable_bytes == 0 and stat.tenant_usage.sessions == 0
        hits = {t.name: (t.lookups, t.hits) for t in stat.tiers}
        assert hits["host"][1] >= 10  # every chunk read (6 + 3 + 1) hit the host tier


async def test_a_session_and_written_chunks_dedupe_both_ways(tmp_path):
    tokens, chunks, full = encoded(3)
    theirs, their_chunks, their_full = encoded(3, seed=5)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.spill("acme", "a", LAYOUT.name, tokens, full, generation=1)
        written = await kv.write_chunks("acme", LAYOUT.name, tokens, chunks, skip_held=False)
        assert (written.chunks_written, written.chunks_deduped) == (0, 3)
        read = await kv.read_chunks("acme", LAYOUT.name, tokens)  # the session's chunks
        assert [bytes(read.chunks[i]) for i in range(3)] == chunks
        assert (await kv.stat()).retained_chunks == 0  # the session references them
        # skip_held: a Lookup finds them, nothing is sent
        assert (await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)).chunks_deduped == 3

        await kv.write_chunks("acme", LAYOUT.name, theirs, their_chunks)
        assert (await kv.stat()).retained_chunks == 3
        spilled = await kv.spill("acme", "b", LAYOUT.name, theirs, their_full, generation=1)
        assert spilled.chunks_deduped == 3  # the written chunks, by key and digest
        assert (await kv.stat()).retained_chunks == 0  # referenced again: no longer cache
        assert_streams_equal((await kv.restore("acme", "b")).persistent, their_full)
        await kv.delete("acme", "b")
        assert (await kv.stat()).retained_chunks == 3  # retained again, still readable
        assert not (await kv.read_chunks("acme", LAYOUT.name, theirs)).missing


async def test_other_bytes_under_a_key_are_another_version(tmp_path):
    tokens, chunks, _ = encoded(2)
    _, other, _ = encoded(2, seed=1)
    relabelled = cc.encode_chunks(LAYOUT, tokens, streams_for(LAYOUT, 2 * C, seed=7))
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        again = await kv.write_chunks("acme", LAYOUT.name, tokens, relabelled)
        assert again.chunks_written == 2  # stored beside, not instead
        first = await kv.read_chunks("acme", LAYOUT.name, tokens,
                                     digests=[chunk_digest(c) for c in chunks])
        second = await kv.read_chunks("acme", LAYOUT.name, tokens,
                                      digests=[chunk_digest(c) for c in relabelled])
        assert [bytes(first.chunks[i]) for i in range(2)] == chunks
        assert [bytes(second.chunks[i]) for i in range(2)] == relabelled
        with pytest.raises(InvalidRequest, match="other token ids"):
            await kv.write_chunks("acme", LAYOUT.name, tokens, other)  # another sequence's


async def test_another_tenant_reads_nothing_and_a_foreign_domain_is_refused(tmp_path):
    tokens, chunks, _ = encoded(2)
    shared = {"dedupe_domains": {"public": ("acme",)}}
    async with running_server(tmp_path, **shared) as (_, target), AsyncClient(target) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        theirs = await kv.read_chunks("other", LAYOUT.name, tokens)
        assert not theirs.chunks and theirs.missing == {0: "not_held", 1: "not_held"}
        assert theirs.keys == keys_of(tokens, "other") != keys_of(tokens)
        # the shared domain is its own: what acme wrote for itself is not in it
        public = await kv.read_chunks("acme", LAYOUT.name, tokens, dedupe_domain="public")
        assert len(public.missing) == 2
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks, dedupe_domain="public")
        public = await kv.read_chunks("acme", LAYOUT.name, tokens, dedupe_domain="public")
        assert sorted(public.chunks) == [0, 1] and public.keys == keys_of(tokens, "x", "public")
        with pytest.raises(PermissionDenied):
            await kv.read_chunks("other", LAYOUT.name, tokens, dedupe_domain="public")
        with pytest.raises(PermissionDenied):
            await kv.write_chunks("other", LAYOUT.name, tokens, chunks,
                                  dedupe_domain="public", skip_held=False)


async def test_corrupt_and_deleted_chunks_are_missing_and_the_rest_arrive(tmp_path):
    tokens, chunks, _ = encoded(4)
    # the host tier takes no chunk: they land on disk alone
    async with running_server(tmp_path, host_bytes=1024, object_bytes=0) as (server, target), \
            AsyncClient(target) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks, ack="durable")
        hits = 0
        for segment in (tmp_path / "disk" / "segments").iterdir():
            raw = bytearray(segment.read_bytes())
            at = raw.find(chunks[1])
            if at >= 0:
                raw[at + len(chunks[1]) - 5] ^= 0xFF
                segment.write_bytes(bytes(raw))
                hits += 1
        assert hits == 1
        keys = [block_key(k, chunk_digest(c)) for k, c in zip(keys_of(tokens), chunks,
                                                               strict=True)]
        await server.manager.tiers[1].delete(keys[2])  # lost behind the store's back
        got = await kv.read_chunks("acme", LAYOUT.name, tokens)
        assert got.missing == {1: "corrupt", 2: "not_held"}
        assert {i: bytes(d) for i, d in got.chunks.items()} == {0: chunks[0], 3: chunks[3]}


async def test_expected_digests_and_bad_requests(tmp_path):
    tokens, chunks, _ = encoded(3)
    digests = [chunk_digest(c) for c in chunks]
    bound = 2 * chunk_bytes_max(LAYOUT, C) + 100  # two of the layout's largest chunks
    async with running_server(tmp_path, max_spill_bytes=bound) \
            as (_, target), AsyncClient(target) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens[:2 * C], chunks[:2])
        got = await kv.read_chunks("acme", LAYOUT.name, tokens, max_chunks=2,
                                   digests=[digests[0], chunk_digest(b"other")])
        assert got.missing == {1: "digest_mismatch"} and sorted(got.chunks) == [0]
        with pytest.raises(InvalidRequest, match="one per chunk"):
            await kv.read_chunks("acme", LAYOUT.name, tokens, max_chunks=2, digests=digests)
        with pytest.raises(InvalidRequest, match="max_spill_bytes"):  # 3 chunks: too many
            await kv.read_chunks("acme", LAYOUT.name, tokens)
        with pytest.raises(InvalidRequest, match="past the"):
            await kv.read_chunks("acme", LAYOUT.name, tokens, first_chunk=4)
        with pytest.raises(InvalidRequest, match="whole chunks"):  # a partial last chunk
            await kv.write_chunks("acme", LAYOUT.name, tokens[:2 * C + 5], chunks[:2],
                                  skip_held=False)
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.KVTierStub(channel)
            header = pb.WriteChunksHeader(tenant="acme", layout_id=LAYOUT.name,
                                          token_ids=tokens[:C].tobytes(),
                                          chunk_digests=digests[:1])
            wrong = pb.Payload(key=keys_of(tokens)[1], data=chunks[0])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.WriteChunks(_messages(pb.WriteChunksRequest(header=header),
                                                 pb.WriteChunksRequest(chunk=wrong)))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not the chain key" in refused.value.details()
            # named by key only, and not held: MissingChunks, nothing stored
            unknown = pb.WriteChunksHeader(tenant="acme", layout_id=LAYOUT.name,
                                           token_ids=tokens.tobytes(), first_chunk=2,
                                           chunk_digests=digests[2:])
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.WriteChunks(_messages(pb.WriteChunksRequest(header=unknown)))
            assert missing.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert dict(missing.value.trailing_metadata())["kvtier-error"] == "MissingChunks"


async def _messages(*messages):
    for message in messages:
        yield message


async def test_retention_off_refuses_writes(tmp_path):
    tokens, chunks, _ = encoded(1)
    async with running_server(tmp_path, retain_unreferenced=False) as (_, target), \
            AsyncClient(target) as kv:
        with pytest.raises(PreconditionFailed, match="retain_unreferenced"):
            await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)


@pytest.mark.skipif(not shm.available(), reason="no /dev/shm")
async def test_shared_memory_both_ways(tmp_path):
    tokens, chunks, _ = encoded(3)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        metrics = server.servicer.metrics
        before = metrics.restore_bytes.labels("shm")._value.get()
        sent = metrics.spill_bytes.labels("shm")._value.get()
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        assert metrics.spill_bytes.labels("shm")._value.get() - sent == sum(map(len, chunks))
        for _ in range(2):  # the second offers the segment the first left it
            got = await kv.read_chunks("acme", LAYOUT.name, tokens)
            assert [bytes(got.chunks[i]) for i in range(3)] == chunks
        assert metrics.restore_bytes.labels("shm")._value.get() - before == \
            2 * sum(map(len, chunks))
        inline = await kv.read_chunks("acme", LAYOUT.name, tokens, use_shared_memory=False)
        assert [bytes(inline.chunks[i]) for i in range(3)] == chunks


@pytest.mark.skipif(not shm.available(), reason="no /dev/shm")
async def test_a_read_in_place_holds_its_segment_until_released(tmp_path):
    """Chunks read in place from below the host tier (here the disk) are views of the
    reply segment: a read meanwhile gets another segment (the lent one is offered for no
    reply), and once released it serves again."""
    tokens, chunks, _ = encoded(3)
    theirs, their_chunks, _ = encoded(3, seed=5)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=True) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks, ack="durable")
        await kv.write_chunks("acme", LAYOUT.name, theirs, their_chunks, ack="durable")
        await off_the_host_tier(server, tokens, chunks)
        await off_the_host_tier(server, theirs, their_chunks)
        warm = await kv.read_chunks("acme", LAYOUT.name, tokens)  # leaves a kept segment
        assert len(server.servicer.leases) == 1
        held = await kv.read_chunks("acme", LAYOUT.name, tokens, in_place=True)
        assert all(isinstance(held.chunks[i], memoryview) for i in range(3))
        other = await kv.read_chunks("acme", LAYOUT.name, theirs, in_place=True)
        assert len(server.servicer.leases) == 2  # not written into the lent one
        assert [bytes(held.chunks[i]) for i in range(3)] == chunks
        assert [bytes(other.chunks[i]) for i in range(3)] == their_chunks
        held.release()
        other.release()
        held.release()  # once only
        await asyncio.sleep(0.05)  # given back on the client's loop
        with await kv.read_chunks("acme", LAYOUT.name, theirs, in_place=True) as again:
            assert [bytes(again.chunks[i]) for i in range(3)] == their_chunks
        assert len(server.servicer.leases) == 2
        assert [bytes(warm.chunks[i]) for i in range(3)] == chunks  # a copy, as before


@pytest.mark.skipif(not shm.available(), reason="no /dev/shm")
async def test_chunks_listed_in_the_header_come_in_one_message(tmp_path):
    """Asked for refs_in_header, a reply in shared memory is its header (every chunk read
    written into the segment, the header listing where) and the MissingChunks alone;
    inline, the same request gets a RestoredChunk per chunk."""
    tokens, chunks, _ = encoded(3)
    async with running_server(tmp_path) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv, \
            grpc.aio.insecure_channel(target) as channel:
        await kv.write_chunks("acme", LAYOUT.name, tokens[:2 * C], chunks[:2])
        stub = pb_grpc.KVTierStub(channel)
        request = pb.ReadChunksRequest(tenant="acme", layout_id=LAYOUT.name,
                                       token_ids=tokens.tobytes(), use_shared_memory=True,
                                       refs_in_header=True)
        replies = [r async for r in stub.ReadChunks(request)]
        assert [r.WhichOneof("item") for r in replies] == ["header", "missing"]
        header = replies[0].header
        assert replies[1].missing.index == 2 and header.chunk_refs[2].length == 0
        segment = shm.Segment(header.reply_segment)
        try:
            assert [segment.read(ref) for ref in header.chunk_refs[:2]] == chunks[:2]
        finally:
            segment.close()
            await stub.ReleaseSegments(pb.ReleaseRequest(
                lease_ids=[header.reply_segment.lease_id]))
        request.use_shared_memory = False
        inline = [r async for r in stub.ReadChunks(request)]
        assert [r.WhichOneof("item") for r in inline] == ["header", "chunk", "chunk", "missing"]
        assert not inline[0].header.chunk_refs


def test_a_replys_chunks_are_checked_whole_without_their_digests():
    """Checked together, without digests each chunk's every byte is still checked against
    its checksums and token range: a flipped payload byte or header field is "corrupt"."""
    tokens, chunks, _ = encoded(4)
    header = pb.ChunksHeader(chunk_keys=keys_of(tokens),
                             chunk_digests=[chunk_digest(c) for c in chunks])
    payload = bytearray(chunks[1])
    payload[-5] ^= 0xFF
    start = bytearray(chunks[2])
    start[16] ^= 0x01  # in the header
    got = [(0, chunks[0], ""), (1, bytes(payload), ""), (2, bytes(start), ""),
           (3, memoryview(chunks[3]), "")]
    for check_digests in (False, True):
        result = checked_result(LAYOUT, tokens, 0, header, got, check_digests)
        assert result.missing == {1: "corrupt", 2: "corrupt"}
        assert {i: bytes(d) for i, d in result.chunks.items()} == {0: chunks[0], 3: chunks[3]}
    swapped = checked_result(LAYOUT, tokens, 0, header, [(0, chunks[1], "")], False)
    assert swapped.missing[0] == "corrupt"  # a chunk of other tokens


async def test_written_chunks_give_way_under_pressure(tmp_path):
    tokens, chunks, _ = encoded(3)
    theirs, _, their_full = encoded(3, seed=3)
    size = max(map(len, chunks))
    async with running_server(tmp_path, host_bytes=5 * size + size // 2, disk_bytes=0,
                              object_bytes=0) as (_, target), AsyncClient(target) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        await kv.spill("acme", "b", LAYOUT.name, theirs, their_full, generation=1)
        got = await kv.read_chunks("acme", LAYOUT.name, tokens)
        assert got.missing and set(got.missing.values()) == {"not_held"}
        assert_streams_equal((await kv.restore("acme", "b")).persistent, their_full)


async def test_memory_acks_are_written_back_and_durable_ones_survive_a_restart(tmp_path):
    tokens, chunks, _ = encoded(2)
    theirs, their_chunks, _ = encoded(2, seed=2)
    keys = [block_key(k, chunk_digest(c)) for k, c in zip(keys_of(theirs), their_chunks,
                                                           strict=True)]
    async with running_server(tmp_path) as (server, target), AsyncClient(target) as kv:
        written = await kv.write_chunks("acme", LAYOUT.name, tokens, chunks, ack="durable")
        assert written.durable
        memory = await kv.write_chunks("acme", LAYOUT.name, theirs, their_chunks)
        assert not memory.durable and memory.tier == "host"
        await server.manager.drain()
        assert all("disk" in server.manager.where(key) for key in keys)  # written back
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        got = await kv.read_chunks("acme", LAYOUT.name, tokens)
        assert [bytes(got.chunks[i]) for i in range(2)] == chunks
        usage = (await kv.stat(usage_of="acme")).tenant_usage
        # the marks came back: the chunks are still the tenant's domain's
        assert usage.retained_bytes == sum(map(len, chunks)) + sum(map(len, their_chunks))


async def test_the_durable_bytes_quota_bounds_a_domains_written_chunks(tmp_path):
    tokens, chunks, _ = encoded(3)
    theirs, their_chunks, _ = encoded(3, seed=4)
    both, both_chunks, _ = encoded(6, seed=6)
    limit = sum(map(len, chunks)) + len(chunks[0]) // 2
    async with running_server(tmp_path, quota={"acme": {"durable_bytes": limit}}) \
            as (_, target), AsyncClient(target) as kv:
        with pytest.raises(QuotaExceeded, match="durable_bytes"):  # alone past the limit
            await kv.write_chunks("acme", LAYOUT.name, both, both_chunks)
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        usage = (await kv.stat(usage_of="acme")).tenant_usage
        assert usage.retained_bytes == sum(map(len, chunks)) <= limit
        assert usage.durable_bytes == 0  # no session's
        # a second prefix needs the room: the first one's least recently used go first
        await kv.write_chunks("acme", LAYOUT.name, theirs, their_chunks)
        usage = (await kv.stat(usage_of="acme")).tenant_usage
        assert usage.retained_bytes <= limit
        assert not (await kv.read_chunks("acme", LAYOUT.name, theirs)).missing
        assert (await kv.read_chunks("acme", LAYOUT.name, tokens)).missing
        # a tenant without a limit writes as much as it likes
        assert (await kv.write_chunks("beta", LAYOUT.name, both, both_chunks)
                ).chunks_written == 6


async def test_the_golden_vectors_messages_get_the_stated_keys(tmp_path):
    vectors = json.loads((ROOT / "tests" / "vectors" / "prefix_chunks.json").read_text())
    domains = {"dedupe_domains": {c["dedupe_domain"]: ("acme",) for c in vectors["cases"]
                                  if c["dedupe_domain"]}}
    async with running_server(tmp_path, **domains) as (_, target), \
            AsyncClient(target) as kv, grpc.aio.insecure_channel(target) as channel:
        assert await kv.register_layout(wire_layout()) == vectors["layout_id"]
        stub = pb_grpc.KVTierStub(channel)
        for case in vectors["cases"]:
            header = pb.WriteChunksHeader.FromString(
                bytes.fromhex(case["write_header"]["bytes"]))
            payloads = [pb.WriteChunksRequest(chunk=pb.Payload(
                key=key, data=bytes.fromhex(chunk["bytes"])))
                for key, chunk in zip(case["payload_keys"], vectors["chunks"], strict=True)]
            reply = await stub.WriteChunks(_messages(pb.WriteChunksRequest(header=header),
                                                     *payloads))
            assert list(reply.chunk_keys) == case["reply_chunk_keys"] and reply.durable
            request = pb.ReadChunksRequest.FromString(
                bytes.fromhex(case["read_request"]["bytes"]))
            replies = [r async for r in stub.ReadChunks(request)]
            assert list(replies[0].header.chunk_keys) == case["read_chunk_keys"]
            assert replies[1].chunk.index == 1
            assert replies[1].chunk.payload.data.hex() == vectors["chunks"][0]["bytes"]


async def test_a_host_copy_is_hashed_by_its_first_read_only_and_digests_can_be_left_to_checksums(
        tmp_path):
    tokens, chunks, _ = encoded(3)
    async with running_server(tmp_path) as (server, target), AsyncClient(target) as kv:
        await kv.write_chunks("acme", LAYOUT.name, tokens, chunks)
        host = next(t for t in server.manager.tiers if t.name == "host")
        keys = [block_key(k, chunk_digest(c)) for k, c in zip(keys_of(tokens), chunks,
                                                               strict=True)]
        assert (await host.get_many_proven(keys))[1] == [False] * 3
        first = await kv.read_chunks("acme", LAYOUT.name, tokens)  # hashed by the server
        assert (await host.get_many_proven(keys))[1] == [True] * 3
        again = await kv.read_chunks("acme", LAYOUT.name, tokens, check_digests=False)
        assert [bytes(again.chunks[i]) for i in range(3)] == chunks
        assert [bytes(first.chunks[i]) for i in range(3)] == chunks
