"""A bad input for every RPC: a specific status and message, nothing stored, the server
still serving, and never a wrong tensor (a corrupt chunk on disk gives DATA_LOSS)."""

from __future__ import annotations

import logging

import grpc
import pytest

from kvstore.format.keys import dedupe_scope
from kvtier.codec import as_tokens, encode_session, encode_window
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from tests.support.service import (
    LAYOUT,
    raw_spill_header,
    running_server,
    streams_for,
    tokens_for,
)

TOKENS = LAYOUT.chunk_tokens + 40
REF = pb.SessionRef(tenant="acme", session_id="s1")


def _session():
    tokens = as_tokens(tokens_for(TOKENS))
    return tokens, encode_session(LAYOUT, tokens, streams_for(LAYOUT, TOKENS),
                                  scope=dedupe_scope(REF.tenant))


def _header(tokens, **changes) -> pb.SpillHeader:
    return raw_spill_header(REF, tokens, _session()[1], **changes)


def _messages(header, enc, chunk0=None):
    yield pb.SpillRequest(header=header)
    yield pb.SpillRequest(chunk=pb.Payload(key=enc.keys[0], data=chunk0 or enc.chunks[0]))
    yield pb.SpillRequest(tail=pb.Payload(data=enc.tail))


async def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    return info.value.code(), info.value.details()


async def test_spill_refuses_bad_streams(tmp_path):
    tokens, enc = _session()
    flipped = bytearray(enc.chunks[0])
    flipped[-10] ^= 0xFF
    out_of_vocab = tokens.copy()
    out_of_vocab[3] = LAYOUT.vocab_size
    # Window K/V over every token, not the last W = 128: bounded by W, not by the session.
    too_wide = encode_window(LAYOUT, tokens, streams_for(
        LAYOUT, TOKENS, streams=[s for s in LAYOUT.ephemeral_streams if not s.pending]))
    bad = {
        "tenant": (_messages(_header(tokens, session=pb.SessionRef(tenant="ACME",
                                                                     session_id="s1")), enc),
                   "tenant"),
        "layout": (_messages(_header(tokens, layout_id="no-such-layout"), enc),
                   "unknown layout"),
        "token bytes": (_messages(_header(tokens, token_ids=tokens.tobytes()[:-1]), enc),
                        "multiple of 4"),
        "keys": (_messages(_header(tokens, chunk_keys=["0" * 32]), enc), "chain to"),
        "order": (iter([pb.SpillRequest(tail=pb.Payload(data=enc.tail))]), "first message"),
        "checksum": (_messages(_header(tokens), enc, bytes(flipped)), "do not verify"),
        "range": (iter([pb.SpillRequest(header=_header(tokens)),
                        pb.SpillRequest(chunk=pb.Payload(key=enc.keys[0], data=enc.tail))]),
                  "covers tokens"),
        "no such lease": (iter([pb.SpillRequest(header=_header(tokens)),
                                pb.SpillRequest(chunk=pb.Payload(
                                    key=enc.keys[0], shm=pb.SharedMemoryRef(
                                        lease_id="no-such-lease", offset=0, length=10)))]),
                          "not held by this client"),
        "vocabulary": (_messages(_header(out_of_vocab), enc), "vocab_size 256"),
        "window wider than W": (iter([pb.SpillRequest(header=_header(tokens)),
                                      pb.SpillRequest(window=pb.Payload(data=too_wide))]),
                                "encodes it in at most"),
        "twice": (iter([pb.SpillRequest(header=_header(tokens)),
                        pb.SpillRequest(tail=pb.Payload(data=enc.tail)),
                        pb.SpillRequest(tail=pb.Payload(data=enc.tail))]), "twice"),
    }
    async with running_server(tmp_path) as (_, target), \
            grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        for name, (messages, needle) in bad.items():
            code, details = await _status(lambda m=messages: stub.Spill(m))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, details)
            assert needle in details, (name, details)
        # Nothing was stored by any of them; a good spill still works (again: a retry gets
        # the same reply), an older one is stale.
        assert not (await stub.List(pb.ListRequest())).sessions
        first = await stub.Spill(_messages(_header(tokens), enc))
        assert await stub.Spill(_messages(_header(tokens), enc)) == first
        code, details = await _status(
            lambda: stub.Spill(_messages(_header(tokens, generation=0), enc)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "generation" in details


async def test_every_control_rpc_refuses_bad_input(tmp_path):
    unknown = pb.SessionRef(tenant="acme", session_id="nobody")
    bad_id = pb.SessionRef(tenant="acme", session_id="has space")
    async with running_server(tmp_path) as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        cases = [
            (lambda: stub.Restore(pb.RestoreRequest(session=unknown)), "NOT_FOUND"),
            (lambda: stub.Restore(pb.RestoreRequest(session=bad_id)), "INVALID_ARGUMENT"),
            (lambda: stub.Resume(pb.ResumeRequest(session=unknown)), "NOT_FOUND"),
            (lambda: stub.Resume(pb.ResumeRequest()), "INVALID_ARGUMENT"),
            (lambda: stub.Prefetch(pb.PrefetchRequest(session=REF, timeout_s=-1)),
             "INVALID_ARGUMENT"),
            (lambda: stub.Prefetch(pb.PrefetchRequest(session=unknown)), "NOT_FOUND"),
            (lambda: stub.Evict(pb.EvictRequest(session=REF, target_tier="tape")),
             "INVALID_ARGUMENT"),
            (lambda: stub.Evict(pb.EvictRequest(session=unknown)), "NOT_FOUND"),
            (lambda: stub.Delete(pb.DeleteRequest(session=unknown)), "NOT_FOUND"),
            (lambda: stub.Delete(pb.DeleteRequest(session=bad_id)), "INVALID_ARGUMENT"),
            (lambda: stub.Stat(pb.StatRequest(session=unknown)), "NOT_FOUND"),
            (lambda: stub.List(pb.ListRequest(tenant="A/B")), "INVALID_ARGUMENT"),
            (lambda: stub.List(pb.ListRequest(page_size=10_000)), "INVALID_ARGUMENT"),
        ]
        for call, want in cases:
            code, details = await _status(call)
            assert code.name == want, details
        errors = server.metrics.registry.get_sample_value
        assert errors("kvtier_requests_total", {"method": "Delete", "code": "NOT_FOUND"}) == 1
        assert errors("kvtier_requests_total", {"method": "List",
                                                "code": "INVALID_ARGUMENT"}) == 2
        health = await stub.Stat(pb.StatRequest())
        assert health.sessions == 0


async def test_corrupt_chunk_on_disk_is_data_loss_not_a_tensor(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    tokens, enc = _session()
    async with running_server(tmp_path, object_bytes=0) as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KVTierStub(channel)
        await stub.Spill(_messages(_header(tokens), enc))
        await stub.Evict(pb.EvictRequest(session=REF, target_tier="disk"))
        await server.manager.drain()
        hits = 0
        for segment in (tmp_path / "disk" / "segments").iterdir():
            raw = bytearray(segment.read_bytes())
            at = raw.find(enc.chunks[0])
            if at >= 0:
                raw[at + len(enc.chunks[0]) - 5] ^= 0xFF
                segment.write_bytes(bytes(raw))
                hits += 1
        assert hits == 1
        code, details = await _status(lambda: stub.Restore(pb.RestoreRequest(session=REF)))
        assert code == grpc.StatusCode.DATA_LOSS and "checksum" in details
        # The client learns no server path nor offset; the server's log has both.
        assert str(tmp_path) not in details and "/disk" not in details, details
        assert "segment" not in details and "@" not in details, details
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert f"disk tier {tmp_path / 'disk'}, segment " in logged and " @ " in logged
        # The server is still serving, and still refuses rather than guessing.
        code, _ = await _status(lambda: stub.Restore(pb.RestoreRequest(session=REF,
                                                                       layer_by_layer=True)))
        assert code == grpc.StatusCode.DATA_LOSS
        assert (await stub.Stat(pb.StatRequest(session=REF))).session.chunks == 1


async def test_oversize_message_is_refused_clearly(tmp_path):
    from kvstore.format.errors import InvalidRequest
    from kvtier import AsyncClient

    tokens = tokens_for(LAYOUT.chunk_tokens)
    blob = b"x" * (3 << 19)  # 1.5 MiB: over the server's 1 MiB message limit
    async with running_server(tmp_path, max_message_bytes=1 << 20) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        with pytest.raises(InvalidRequest, match="RESOURCE_EXHAUSTED"):
            await kv.spill("acme", "s1", LAYOUT.name, tokens, chunks=[blob], generation=1)
        async with AsyncClient(target, shared_memory=False, max_message_bytes=1 << 20) as small:
            with pytest.raises(InvalidRequest, match="message limit"):
                await small.spill("acme", "s1", LAYOUT.name, tokens, chunks=[blob],
                                  generation=1)
        assert await kv.list() == []



async def test_a_restored_block_over_the_message_limit_is_message_too_large(tmp_path):
    from kvstore.format.errors import MessageTooLarge, TierFull
    from kvstore.format.presets import DEEPSEEK_LLM_67B as BIG  # 6 MB chunks
    from kvtier import AsyncClient

    tokens = tokens_for(BIG.chunk_tokens)
    async with running_server(tmp_path) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await kv.spill("acme", "s1", BIG.name, tokens, streams_for(BIG, len(tokens)),
                       generation=1)
    async with running_server(tmp_path, max_message_bytes=1 << 20) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        with pytest.raises(MessageTooLarge, match="RESOURCE_EXHAUSTED.*message limit") as err:
            await kv.restore("acme", "s1")
        assert not isinstance(err.value, TierFull)
