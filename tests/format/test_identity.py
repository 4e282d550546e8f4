"""Chunk identity over a real server: a chunk is deduped only within
the spiller's dedupe domain, for the same layout and model fingerprint, and only when its
bytes are the very bytes stored; every restored byte is checked against its digest."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kvstore.format.errors import DataLoss, InvalidRequest, PermissionDenied
from kvstore.format.keys import chunk_digest, dedupe_scope
from kvstore.format.registry import register_layout
from kvtier import AsyncClient
from kvtier.codec import as_tokens, check_digests, encode_session
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    raw_spill_header,
    running_server,
    streams_for,
    tokens_for,
)

N = 2 * LAYOUT.chunk_tokens + 40  # two chunks and a tail
SHARED = {"dedupe_domains": {"public": ("acme", "beta")}}


def _session(seed: int):
    return as_tokens(tokens_for(N)), streams_for(LAYOUT, N, seed=seed)


async def test_another_tenants_chunks_for_the_same_tokens_are_never_handed_out(tmp_path):
    tokens, evil_kv = _session(seed=66)
    _, victim_kv = _session(seed=0)
    async with running_server(tmp_path) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await kv.spill("evil", "bait", LAYOUT.name, tokens, evil_kv, generation=1)
        victim = await kv.spill("victim", "s1", LAYOUT.name, tokens, victim_kv, generation=1)
        # Nothing is deduped across tenants (nor does the count tell the victim anything).
        assert victim.chunks_deduped == 0 and victim.chunks_written == 2
        got = await kv.restore("victim", "s1")
        assert_streams_equal(got.persistent, victim_kv)
        assert_streams_equal((await kv.restore("evil", "bait")).persistent, evil_kv)


async def test_two_fine_tunes_of_one_layout_never_share_chunks(tmp_path):
    tokens, base_kv = _session(seed=1)
    _, tuned_kv = _session(seed=2)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await kv.spill("acme", "base", LAYOUT.name, tokens, base_kv, generation=1,
                       model_fingerprint="base-v1")
        tuned = await kv.spill("acme", "tuned", LAYOUT.name, tokens, tuned_kv, generation=1,
                               model_fingerprint="base-v1-ft-legal")
        assert tuned.chunks_deduped == 0
        base_keys = set((await server.manager.get_manifest("acme", "base")).chunk_keys)
        tuned_keys = set((await server.manager.get_manifest("acme", "tuned")).chunk_keys)
        assert not base_keys & tuned_keys
        assert_streams_equal((await kv.restore("acme", "base")).persistent, base_kv)
        assert_streams_equal((await kv.restore("acme", "tuned")).persistent, tuned_kv)
        # The same model again does dedupe (the fingerprint is what tells models apart).
        again = await kv.spill("acme", "base-2", LAYOUT.name, tokens, base_kv, generation=1,
                               model_fingerprint="base-v1")
        assert again.chunks_deduped == 2


async def test_a_layout_that_requires_a_fingerprint_refuses_a_spill_without_one(tmp_path):
    strict = register_layout(dataclasses.replace(LAYOUT, name="kvtier-bundled-fingerprinted",
                                                 requires_model_fingerprint=True))
    assert strict.layout_hash != LAYOUT.layout_hash
    tokens, persistent = _session(seed=3)
    async with running_server(tmp_path) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        with pytest.raises(InvalidRequest, match="model_fingerprint"):
            await kv.spill("acme", "s1", strict, tokens, persistent, generation=1)
        reply = await kv.spill("acme", "s1", strict, tokens, persistent, generation=1,
                               model_fingerprint="weights-sha256-abc")
        assert reply.generation == 1
        got = await kv.restore("acme", "s1")
        assert_streams_equal(got.persistent, persistent)


async def test_a_stated_digest_that_does_not_match_the_bytes_is_refused(tmp_path):
    ref = pb.SessionRef(tenant="acme", session_id="s1")
    tokens, persistent = _session(seed=4)
    enc = encode_session(LAYOUT, tokens, persistent, scope=dedupe_scope("acme"))
    other = encode_session(LAYOUT, tokens, streams_for(LAYOUT, N, seed=5),
                           scope=dedupe_scope("acme"))

    def messages(header, chunks):
        yield pb.SpillRequest(header=header)
        for i, data in enumerate(chunks):
            yield pb.SpillRequest(chunk=pb.Payload(key=enc.keys[i], data=data))
        yield pb.SpillRequest(tail=pb.Payload(data=enc.tail))

    bad_chunk = raw_spill_header(ref, tokens, enc, chunk_digests=other.digests)
    bad_tail = raw_spill_header(ref, tokens, enc, tail_digest=chunk_digest(other.tail))
    async with running_server(tmp_path) as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        for header, needle in ((bad_chunk, "digest its key states"),
                               (bad_tail, "header.tail_digest")):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Spill(messages(header, [enc.chunks[0], enc.chunks[1]]))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in info.value.details(), info.value.details()
        assert not (await stub.List(pb.ListRequest())).sessions
        assert all(not server.manager.where(k) for k in raw_spill_header(
            ref, tokens, other).chunk_keys)
        # A chunk sent by key only is honoured only with the digest the server holds.
        await stub.Spill(messages(raw_spill_header(ref, tokens, enc), enc.chunks.values()))
        key_only = raw_spill_header(ref, tokens, other, generation=2,
                                    tail_digest=chunk_digest(enc.tail))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Spill(messages(key_only, []))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # MissingChunks
        assert "MissingChunks" in dict(info.value.trailing_metadata()).values()


async def test_a_shared_domain_dedupes_between_its_tenants_only_when_digests_agree(tmp_path):
    tokens, prompt_kv = _session(seed=7)
    _, forged_kv = _session(seed=8)
    async with running_server(tmp_path, **SHARED) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        first = await kv.spill("acme", "s1", LAYOUT.name, tokens, prompt_kv, generation=1,
                               dedupe_domain="public")
        assert first.chunks_deduped == 0
        same = await kv.spill("beta", "s1", LAYOUT.name, tokens, prompt_kv, generation=1,
                              dedupe_domain="public")
        assert same.chunks_deduped == 2 and same.chunks_written == 0
        # Other bytes for the same tokens in the same domain: stored as their own version.
        forged = await kv.spill("beta", "s2", LAYOUT.name, tokens, forged_kv, generation=1,
                                dedupe_domain="public")
        assert forged.chunks_deduped == 0 and forged.chunks_written == 2
        assert_streams_equal((await kv.restore("acme", "s1")).persistent, prompt_kv)
        assert_streams_equal((await kv.restore("beta", "s1")).persistent, prompt_kv)
        assert_streams_equal((await kv.restore("beta", "s2")).persistent, forged_kv)
        # The tenant's own domain does not see the shared one's chunks.
        own = await kv.spill("acme", "s3", LAYOUT.name, tokens, prompt_kv, generation=1)
        assert own.chunks_deduped == 0


async def test_a_tenant_not_in_a_shared_domain_cannot_use_it(tmp_path):
    tokens, persistent = _session(seed=9)
    async with running_server(tmp_path, **SHARED) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await kv.spill("acme", "s1", LAYOUT.name, tokens, persistent, generation=1,
                       dedupe_domain="public")
        for domain in ("public", "no-such-domain"):  # unknown and forbidden read alike
            with pytest.raises(PermissionDenied, match="may not use dedupe domain"):
                await kv.spill("gamma", "s1", LAYOUT.name, tokens, persistent, generation=1,
                               dedupe_domain=domain)
        assert not await kv.list("gamma")


@pytest.mark.parametrize("shm", [False, True])  # inline bytes, and one copy out of a segment
async def test_a_stored_chunk_rewritten_with_another_valid_chunk_is_data_loss(tmp_path, shm):
    tokens, mine = _session(seed=10)
    _, theirs = _session(seed=11)
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=shm) as kv:
        await kv.spill("acme", "mine", LAYOUT.name, tokens, mine, generation=1)
        await kv.spill("acme", "theirs", LAYOUT.name, tokens, theirs, generation=1)
        manager = server.manager
        key = (await manager.get_manifest("acme", "mine")).chunk_keys[0]
        forged, _ = await manager.read_chunk(await manager.get_manifest("acme", "theirs"), 0)
        # A valid chunk of the same tokens and layout: every codec checksum passes.
        for tier in manager.tiers:
            if tier.name in manager.where(key):
                await tier.put(key, bytes(forged))
        with pytest.raises(DataLoss):
            await kv.restore("acme", "mine")
        assert_streams_equal((await kv.restore("acme", "theirs")).persistent, theirs)


def test_the_client_checks_restored_bytes_against_the_stated_digests():
    tokens, persistent = _session(seed=12)
    enc = encode_session(LAYOUT, tokens, persistent, scope=dedupe_scope("acme"))
    chunks = [enc.chunks[0], enc.chunks[1]]
    check_digests(chunks, enc.digests, enc.tail, chunk_digest(enc.tail))
    with pytest.raises(DataLoss, match="chunk 1"):
        check_digests([chunks[0], chunks[0]], enc.digests, enc.tail, chunk_digest(enc.tail))
    with pytest.raises(DataLoss, match="tail"):
        check_digests(chunks, enc.digests, enc.tail, chunk_digest(b"other"))
    with pytest.raises(DataLoss, match="digests"):
        check_digests(chunks[:1], enc.digests, enc.tail, chunk_digest(enc.tail))
