"""Where chunk identity and model identity cross other features, over a real server: no
cache of the client's (a lookup, an earlier spill) stands in for the digest of the bytes
spilled now; the server honours a chunk named by key only with the digest it holds; and
the model fingerprint travels with every session, is returned by Restore, Resume and
Stat, and is enforced on restore, resume and replay (``ModelMismatch``)."""

from __future__ import annotations

import grpc
import pytest
import torch

from kvstore.encryption.claims import DomainClaims
from kvstore.format.errors import MissingChunks, PreconditionFailed, status_name
from kvstore.format.keys import dedupe_scope
from kvtier import AsyncClient, Client, ModelMismatch  # exported for clients to catch
from kvtier.codec import as_tokens, encode_session
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
TOKENS = as_tokens(tokens_for(N))
A = streams_for(LAYOUT, N, seed=21)
B = streams_for(LAYOUT, N, seed=22)  # other tensors under the same tokens


def _sealed(tmp_path, sealed: bool) -> dict:
    """Server options: encryption at rest on (a keyring file made here) or off."""
    if not sealed:
        return {}
    key_file = tmp_path / "keys.toml"
    key_file.write_text(f'[[key]]\nid = "k1"\nmaterial = "{"A" * 43}="\n')
    return {"encryption_key_file": str(key_file)}


def _encoded(streams) -> list[bytes]:
    enc = encode_session(LAYOUT, TOKENS, streams, scope=dedupe_scope("acme"))
    return [enc.chunks[i] for i in range(len(enc.keys))], enc.tail


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
@pytest.mark.parametrize("given", ["streams", "chunks"])
async def test_a_lookup_never_names_other_bytes_for_a_later_spill(tmp_path, given, sealed):
    async def spill(kv, session, streams):
        if given == "streams":
            return await kv.spill("acme", session, LAYOUT.name, TOKENS, streams, generation=1)
        chunks, tail = _encoded(streams)
        return await kv.spill("acme", session, LAYOUT.name, TOKENS, chunks=chunks, tail=tail,
                              generation=1)

    async with running_server(tmp_path, **_sealed(tmp_path, sealed)) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await spill(kv, "a", A)
        assert await kv.lookup("acme", LAYOUT.name, TOKENS) == 2 * LAYOUT.chunk_tokens
        b = await spill(kv, "b", B)
        assert (b.chunks_sent, b.chunks_written, b.chunks_deduped) == (2, 2, 0)
        assert_streams_equal((await kv.restore("acme", "b")).persistent, B)
        assert_streams_equal((await kv.restore("acme", "a")).persistent, A)
        # The very bytes again: the lookup still saves sending them.
        again = await spill(kv, "a2", A)
        assert (again.chunks_sent, again.chunks_deduped) == (0, 2)
        assert_streams_equal((await kv.restore("acme", "a2")).persistent, A)


async def test_a_second_spill_of_a_session_with_other_tensors_sends_them(tmp_path):
    async with running_server(tmp_path) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await kv.spill("acme", "s", LAYOUT.name, TOKENS, A, generation=1)
        second = await kv.spill("acme", "s", LAYOUT.name, TOKENS, B, generation=2)
        assert second.chunks_sent == 2
        assert_streams_equal((await kv.restore("acme", "s")).persistent, B)
        third = await kv.spill("acme", "s", LAYOUT.name, TOKENS, B, generation=3)
        assert third.chunks_sent == 0  # unchanged bytes go by key and digest
        assert_streams_equal((await kv.restore("acme", "s")).persistent, B)


def test_the_blocking_client_after_a_lookup_spills_its_own_bytes(tmp_path):
    import asyncio

    async def main():
        async with running_server(tmp_path) as (_, target):
            await asyncio.to_thread(blocking, target)

    def blocking(target):
        with Client(target, shared_memory=False) as kv:
            kv.spill("acme", "a", LAYOUT.name, TOKENS, A, generation=1)
            kv.lookup("acme", LAYOUT.name, TOKENS)
            kv.spill("acme", "b", LAYOUT.name, TOKENS, B, generation=1)
            assert_streams_equal(kv.restore("acme", "b").persistent, B)

    asyncio.run(main())


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
async def test_the_server_honours_a_chunk_named_by_key_only_with_the_held_digest(tmp_path,
                                                                                sealed):
    """A raw client naming the chunks another session holds, under the digest of its own
    other bytes, without sending them: MissingChunks, and nothing of it stored."""
    ref = pb.SessionRef(tenant="acme", session_id="b")
    a = encode_session(LAYOUT, TOKENS, A, scope=dedupe_scope("acme"))
    b = encode_session(LAYOUT, TOKENS, B, scope=dedupe_scope("acme"))
    assert a.keys == b.keys and a.digests != b.digests

    def messages(header, chunks=(), tail=b""):
        yield pb.SpillRequest(header=header)
        for key, data in chunks:
            yield pb.SpillRequest(chunk=pb.Payload(key=key, data=data))
        if tail:
            yield pb.SpillRequest(tail=pb.Payload(data=tail))

    async with running_server(tmp_path, **_sealed(tmp_path, sealed)) as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        assert isinstance(server.manager.write_hook, DomainClaims) == sealed
        stub = pb_grpc.KVTierStub(channel)
        await stub.Spill(messages(raw_spill_header(pb.SessionRef(tenant="acme", session_id="a"),
                                                   TOKENS, a),
                                  zip(a.keys, a.chunks.values(), strict=True), a.tail))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Spill(messages(raw_spill_header(ref, TOKENS, b), (), b.tail))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(info.value.trailing_metadata())["kvtier-error"] == MissingChunks.__name__
        assert (await stub.Stat(pb.StatRequest())).sessions == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Stat(pb.StatRequest(session=ref))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # Its own bytes go in, and come back; the first session's are untouched.
        await stub.Spill(messages(raw_spill_header(ref, TOKENS, b),
                                  zip(b.keys, b.chunks.values(), strict=True), b.tail))
        got = (await server.manager.get_manifest("acme", "b")).chunk_keys
        assert got != (await server.manager.get_manifest("acme", "a")).chunk_keys


# -- model identity --





async def test_restore_resume_stat_and_list_return_the_sessions_fingerprint(tmp_path):
    async with running_server(tmp_path) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await kv.spill("acme", "s", LAYOUT.name, TOKENS, A, window=_window(),
                       generation=1, model_fingerprint="base-v1")
        await kv.spill("acme", "old", LAYOUT.name, TOKENS, A, generation=1)
        assert (await kv.restore("acme", "s")).model_fingerprint == "base-v1"
        assert (await kv.resume("acme", "s")).model_fingerprint == "base-v1"
        assert (await kv.stat("acme", "s")).session.model_fingerprint == "base-v1"
        listed = {i.session.session_id: i.model_fingerprint for i in await kv.list("acme")}
        assert listed == {"s": "base-v1", "old": ""}
        assert (await kv.restore("acme", "old")).model_fingerprint == ""  # none stated


async def test_a_stated_fingerprint_other_than_the_sessions_is_model_mismatch(tmp_path):
    async with running_server(tmp_path) as (_, target), \
            AsyncClient(target, shared_memory=False) as kv, \
            grpc.aio.insecure_channel(target) as channel:
        await kv.spill("acme", "s", LAYOUT.name, TOKENS, A, window=_window(),
                       generation=1, model_fingerprint="base-v1")
        await kv.spill("acme", "old", LAYOUT.name, TOKENS, A, generation=1)
        stub = pb_grpc.KVTierStub(channel)
        ref = pb.SessionRef(tenant="acme", session_id="s")
        for call in (stub.Restore(pb.RestoreRequest(session=ref, model_fingerprint="ft-legal")),
                     stub.Restore(pb.RestoreRequest(session=ref, layer_by_layer=True,
                                                    model_fingerprint="ft-legal")),
                     stub.Resume(pb.ResumeRequest(session=ref, model_fingerprint="ft-legal"))):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                replies = [reply async for reply in call]
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert dict(info.value.trailing_metadata())["kvtier-error"] == "ModelMismatch"
            assert "base-v1" in info.value.details()
        for restore in (lambda **kw: kv.restore("acme", "s", **kw),
                        lambda **kw: kv.resume("acme", "s", **kw),
                        lambda **kw: _layers(kv.restore_layers("acme", "s", **kw))):
            with pytest.raises(ModelMismatch) as caught:
                await restore(model_fingerprint="ft-legal")
            assert isinstance(caught.value, PreconditionFailed)
            await restore(model_fingerprint="base-v1")  # its own model
            await restore()  # none stated: not checked
        # A session that states no model cannot vouch for one.
        with pytest.raises(ModelMismatch, match="without a model fingerprint"):
            await kv.restore("acme", "old", model_fingerprint="base-v1")
        assert_streams_equal((await kv.restore("acme", "old")).persistent, A)
        replies = [reply async for reply in stub.Restore(pb.RestoreRequest(
            session=ref, model_fingerprint="base-v1"))]
        assert replies[0].header.model_fingerprint == "base-v1"
        with pytest.raises(grpc.aio.AioRpcError) as info:  # bounded like a spill's
            [reply async for reply in stub.Resume(pb.ResumeRequest(
                session=ref, model_fingerprint="x" * 257))]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_manifest_written_without_a_fingerprint_reads_as_none_stated():
    import json
    import struct

    import xxhash

    from kvstore.session.manifest import SessionManifest

    raw = SessionManifest(tenant="acme", session_id="s", layout_id=LAYOUT.layout_id,
                          generation=1, token_ids=[1, 2, 3], chunk_keys=(), chunk_sizes=(),
                          model_fingerprint="base-v1").encode()
    head = struct.Struct("<4sHI")
    magic, version, size = head.unpack_from(raw)
    body = json.loads(raw[head.size:head.size + size])
    assert body.pop("model_fingerprint") == "base-v1"
    text = json.dumps(body).encode()
    old = head.pack(magic, version, len(text)) + text + raw[head.size + size:-8]
    old += struct.pack("<Q", xxhash.xxh3_64_intdigest(old))
    assert SessionManifest.decode(old).model_fingerprint == ""


async def _layers(stream) -> list:
    return [layer async for layer in stream]


def _window():
    from kvtier.codec import encode_window
    from tests.support.service import window_for

    return encode_window(LAYOUT, TOKENS, window_for(LAYOUT, N))


# -- replayers serve the fingerprint of the model they loaded --


def test_a_model_fingerprint_is_computed_from_every_weight_and_its_config():
    import dataclasses

    from kvstore.format.model_identity import module_fingerprint
    from tests.support.replay import tiny_model

    model = tiny_model(seed=0)
    same = module_fingerprint(tiny_model(seed=0), model.cfg)
    assert module_fingerprint(model, model.cfg) == same and same.startswith("model-b2:")
    assert module_fingerprint(tiny_model(seed=1), model.cfg) != same
    # the same weights under another rotary base compute other keys: another model
    other_base = dataclasses.replace(model.cfg, rope_base=model.cfg.rope_base * 100)
    assert module_fingerprint(model, other_base) != same
    name, weight = next(iter(model.state_dict().items()))
    with torch.no_grad():
        weight.view(-1)[0] = weight.view(-1)[0].item() + 1e-3  # one value, changed a little
    assert module_fingerprint(model, model.cfg) != same, name


def test_a_transformers_models_identity_covers_its_buffers_and_attention_config():
    pytest.importorskip("transformers")
    from bench.hf import tiny_model
    from kvstore.format.model_identity import INERT_FIELDS, config_identity, module_tensors
    from kvtier.integrations.transformers import model_fingerprint

    model = tiny_model(seed=3)
    own = model_fingerprint(model)
    # rotary tables are non-persistent buffers, outside the state dict, yet in the identity
    assert any(name.endswith("inv_freq") for name in set(module_tensors(model))
               - set(model.state_dict()))
    for change in ({"rope_theta": 1e6}, {"sliding_window": 64}, {"partial_rotary_factor": 0.5},
                   {"compress_rope_theta": 1e4}):
        other = tiny_model(seed=3, **change)
        weights = other.state_dict()
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items()), change
        assert model_fingerprint(other) != own, change
    # what never enters the computation is left out: a renamed checkpoint is the same model
    model.config._name_or_path = "elsewhere/tiny"
    assert model_fingerprint(model) == own
    assert not INERT_FIELDS & set(config_identity(model.config))


async def test_the_same_weights_with_another_rope_theta_are_refused_the_session(tmp_path):
    pytest.importorskip("transformers")
    from bench.hf import tiny_model
    from kvtier.integrations.transformers import async_resume_cache, async_spill_cache

    model = tiny_model(seed=3)
    rotated = tiny_model(seed=3, rope_theta=1e6)  # equal state dicts, other keys
    n = 150
    ids = torch.randint(0, model.config.vocab_size, (n,),
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(ids[None], use_cache=True).past_key_values
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await async_spill_cache(kv, "acme", "v4", model, cache, ids, generation=1)
        with pytest.raises(ModelMismatch) as refused:
            await async_resume_cache(kv, "acme", "v4", rotated, replay="local")
        assert status_name(refused.value) == "FAILED_PRECONDITION"
        resumed, tokens = await async_resume_cache(kv, "acme", "v4", model, replay="local")
        assert torch.equal(tokens, ids) and resumed.get_seq_length() == n


async def test_the_bundled_replayer_refuses_a_session_of_other_weights(tmp_path):
    from kvstore.format.model_identity import module_fingerprint
    from replay.worker import ReplayWorker
    from services.replay.remote import RemoteReplay
    from services.replay.server import create_server as create_worker_server
    from tests.support.replay import TINY_SPEC, tiny_model, tiny_session

    served, other = tiny_model(seed=0), tiny_model(seed=1)
    state, chunks, tail = tiny_session(served, 45)
    ids = state.token_ids
    worker = ReplayWorker(served, default_tokens=16)
    assert worker.model_fingerprint == module_fingerprint(served, served.cfg)
    theirs = module_fingerprint(other, other.cfg)
    with pytest.raises(ModelMismatch):
        await worker.rebuild(TINY_SPEC, ids, chunks, tail, model_fingerprint=theirs)
    own = await worker.rebuild(TINY_SPEC, ids, chunks, tail,
                               model_fingerprint=worker.model_fingerprint)
    unstated = await worker.rebuild(TINY_SPEC, ids, chunks, tail)  # "" as before: replayed
    assert own.window == unstated.window

    # A remote worker gets the session's fingerprint in the request and refuses alike.
    server, port = await create_worker_server("127.0.0.1:0", worker)
    remote = RemoteReplay([f"127.0.0.1:{port}"], timeout_s=30)
    try:
        with pytest.raises(ModelMismatch):
            await remote.rebuild(TINY_SPEC, ids, chunks, tail, model_fingerprint=theirs)
        assert (await remote.rebuild(TINY_SPEC, ids, chunks, tail,
                                     model_fingerprint=worker.model_fingerprint)
                ).window == own.window
    finally:
        await remote.close()
        await server.stop(0.5)

    # Through the kvtier server: Resume of a session spilled by other weights is refused,
    # before the window is rebuilt or stored.
    async with running_server(tmp_path) as (kvserver, target), \
            AsyncClient(target, shared_memory=False) as kv:
        kvserver.servicer.use_replay(worker, frozenset({TINY_SPEC.replayer}))
        for name, fingerprint in (("theirs", theirs), ("ours", worker.model_fingerprint),
                                  ("unstated", "")):
            await kv.spill("acme", name, TINY_SPEC, ids, chunks=chunks, tail=tail,
                           generation=1, model_fingerprint=fingerprint)
        with pytest.raises(ModelMismatch, match="other weights"):
            await kv.resume("acme", "theirs", replay_tokens=16)
        assert (await kvserver.manager.get_manifest("acme", "theirs")).window_key is None
        for name in ("ours", "unstated"):
            resumed = await kv.resume("acme", name, replay_tokens=16)
            assert resumed.replayed and bytes(resumed.window_blob) == own.window


async def test_a_transformers_replayer_of_other_weights_refuses_the_clients_session(tmp_path):
    pytest.importorskip("transformers")
    from bench.hf import tiny_model
    from kvtier.integrations.transformers import (
        async_resume_cache,
        async_spill_cache,
        model_fingerprint,
    )
    from replay.transformers_worker import load_model

    model = tiny_model(seed=3)  # the client's
    config_json = tmp_path / "config.json"
    model.config.to_json_file(config_json)
    # the server's replayer: the same config, weights drawn from another seed
    assert model_fingerprint(load_model(config_json, 4)) != model_fingerprint(model)
    assert model_fingerprint(load_model(config_json, 3)) == model_fingerprint(model)
    n = 150
    ids = torch.randint(0, model.config.vocab_size, (n,),
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(ids[None], use_cache=True).past_key_values
    async with running_server(tmp_path / "data", replay_hf_model=str(config_json),
                              replay_hf_seed=4) as (server, target), AsyncClient(target) as kv:
        await async_spill_cache(kv, "acme", "v4", model, cache, ids, generation=1)
        session = await kv.restore("acme", "v4", want_window=False)
        assert session.model_fingerprint == model_fingerprint(model)  # stated by default
        with pytest.raises(ModelMismatch, match="other weights"):
            await async_resume_cache(kv, "acme", "v4", model, replay="server")
        assert (await server.manager.get_manifest("acme", "v4")).window_key is None
        # "auto" falls back to replaying with the client's own weights
        resumed, tokens = await async_resume_cache(kv, "acme", "v4", model, replay="auto")
        assert torch.equal(tokens, ids) and resumed.get_seq_length() == n
        # another model of the same layout is refused the session outright
        with pytest.raises(ModelMismatch):
            await async_resume_cache(kv, "acme", "v4", tiny_model(seed=5), replay="local")
