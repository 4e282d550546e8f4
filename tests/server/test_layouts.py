"""Layouts at run time: the canonical layout encoding and id, the
deepseek-v4.1-flash preset against the report's 890 B/token, and (over real servers)
RegisterLayout / ListLayouts, their refusals and persistence, and Resume on a layout
nothing here can replay."""

from __future__ import annotations

import json

import pytest
import xxhash

from kvstore.format.errors import InvalidRequest
from kvstore.format.layout import BaselineKV, LayoutSpec, Stream, layout_from_json, layout_to_json
from kvstore.format.presets import V41_FLASH_CONFIG, deepseek_v41_layout
from kvstore.format.registry import all_layouts, get_layout

# deepseek-v3's canonical encoding, written out: sorted keys, no spaces, every stream
# field, no notes, no baseline (it has none).
V3_JSON = ('{"chunk_tokens":16,"name":"deepseek-v3","replayer":"none",'
           '"requires_model_fingerprint":false,"streams":[{"bits":16,"entry_shape":[576],'
           '"group_size":0,"layers":61,"name":"latent","pending":false,"persistent":true,'
           '"tokens_per_entry":1}],"vocab_size":129280,"window_tokens":0}')


def test_canonical_encoding_of_a_preset_is_pinned_and_hashed_without_replayer():
    spec = get_layout("deepseek-v3")
    assert layout_to_json(spec) == V3_JSON
    hashed = V3_JSON.replace(',"replayer":"none"', "").encode()
    assert spec.layout_hash == xxhash.xxh3_64_intdigest(hashed, seed=0)
    assert spec.layout_id == "deepseek-v3@b623b41edf7f24f0"  # pinned: ids must not drift
    assert get_layout("kvtier-bundled").layout_id == "kvtier-bundled@02d2b71436373009"


@pytest.mark.parametrize("spec", all_layouts(), ids=lambda s: s.name)
def test_every_preset_round_trips_through_its_canonical_json(spec):
    text = layout_to_json(spec)
    assert text.isascii() and " " not in text
    obj = json.loads(text)
    assert "notes" not in obj and obj["replayer"] == spec.replayer
    back = layout_from_json(text)
    assert back == spec and back.layout_id == spec.layout_id
    assert layout_to_json(back) == text
    # Any other encoding of the same object canonicalises to the same text.
    spaced = json.dumps(dict(reversed(obj.items())), indent=3)
    assert layout_to_json(layout_from_json(spaced)) == text


def test_the_replayer_does_not_change_the_id_and_optional_keys_take_defaults():
    window = Stream("w", (8,), bits=8, group_size=8, persistent=False)
    base = LayoutSpec("rt", (Stream("a", (8,), bits=16), window), chunk_tokens=4,
                      window_tokens=16)
    bundled = LayoutSpec("rt", base.streams, chunk_tokens=4, window_tokens=16,
                         replayer="bundled")
    assert base.layout_id == bundled.layout_id and base != bundled
    short = layout_from_json('{"name":"rt","chunk_tokens":4,"window_tokens":16,"streams":'
                             '[{"name":"a","entry_shape":[8],"bits":16},{"name":"w",'
                             '"entry_shape":[8],"bits":8,"group_size":8,"persistent":false}]}')
    assert short == base
    with_baseline = LayoutSpec("rt2", base.streams, chunk_tokens=4, window_tokens=16,
                               baseline=BaselineKV(2, 1, 8), layer_modes=("full", "reuse"))
    assert layout_from_json(layout_to_json(with_baseline)) == with_baseline


@pytest.mark.parametrize("text, why", [
    ("{", "does not parse"),
    ('{"name":"x","chunk_tokens":4.0,"streams":[]}', "only integers"),
    ('{"name":"x","chunk_tokens":true,"streams":[]}', "chunk_tokens must be a JSON int"),
    ('{"name":"x","chunk_tokens":4,"streams":[],"color":"red"}', "unknown keys"),
    ('{"name":"x","chunk_tokens":4}', "missing keys"),
    ('{"name":"x","name":"y","chunk_tokens":4,"streams":[]}', "repeats a key"),
    ('{"name":"a@b","chunk_tokens":4,"streams":[]}', "layout name"),
    ('{"name":"x","chunk_tokens":4,"streams":[{"name":"s","entry_shape":[8.5],"bits":16}]}',
     "only integers"),
    ('{"name":"x","chunk_tokens":4,"streams":[{"name":"s","entry_shape":[true],"bits":16}]}',
     "must list integers"),
    ('{"name":"x","chunk_tokens":4,"streams":[{"name":"s","entry_shape":[8],"bits":16}],'
     '"replayer":"bundled"}', "nothing to replay"),
    ('{"name":"x","chunk_tokens":4,"streams":[{"name":"s","entry_shape":[8],"bits":16}],'
     '"replayer":"vllm"}', "replayer must be one of"),
    ('{"name":"x","chunk_tokens":4,"streams":[],"vocab_size":NaN}', "only integers"),
    ("[" * 100_000, "does not parse"),
])
def test_bad_layout_json_is_refused_by_name(text, why):
    with pytest.raises(InvalidRequest, match=why):
        layout_from_json(text)


def test_v41_flash_preset_reaches_890_bytes_per_token_with_one_byte_scales():
    spec = get_layout("deepseek-v4.1-flash")
    assert spec == deepseek_v41_layout(V41_FLASH_CONFIG)
    streams = {s.name: s for s in spec.persistent_streams}
    # KV sources 2, 8, 14 pool m = 2 tokens; source 20 (the decoder's) m = 1.
    assert {n: (s.entry_shape, s.bits, s.group_size, s.tokens_per_entry, s.layers)
            for n, s in streams.items()} == {
        "enc.kv": ((512,), 4, 16, 2, 3), "enc.index_keys": ((128,), 4, 32, 2, 3),
        "dec.kv": ((512,), 4, 16, 1, 1), "dec.index_keys": ((128,), 4, 32, 1, 1)}
    # kvtier's fp16 scales: (256 + 32*2) x 3/2 + (64 + 4*2) x 3/2 + 320 + 72 = 980.
    assert spec.persistent_bytes_per_token == 980
    # The reference's 1-byte scales (e4m3 for the KV, ue8m0 for the indexer keys):
    # (256 + 32) x 3/2 + (64 + 4) x 3/2 + 288 + 68 = 890, the report's figure.
    one_byte = sum(s.layers * (s.values_per_entry * s.bits // 8 + s.scales_per_entry)
                   / s.tokens_per_entry for s in streams.values())
    assert one_byte == 890
    assert 389_120 // 890 == 437  # the report's 437x from deepseek-llm-67b
    # Window: 40 layers of one 512-dim K=V latent, int8 per 32 values; the pending rows
    # of an unclosed ratio-2 group: kv + gate, at most m - 1 = 1 token of 3 layers.
    assert spec.ephemeral_bytes_per_token == 40 * (512 + 16 * 2)
    assert spec.pending_bytes_max == 3 * 1024 * 2
    assert spec.window_tokens == 128 and spec.vocab_size == 129_280
    assert spec.layer_modes.count("full") == 4 and spec.layer_modes.count("reindex") == 4
    assert spec.replayer == "none"


# -- over real servers --

GQA = LayoutSpec(  # plain GQA at bf16: 32 layers x 8 KV heads x 128 dims, K and V
    name="gqa-32x8x128-bf16",
    streams=(Stream("k", (8, 128), bits=16, layers=32),
             Stream("v", (8, 128), bits=16, layers=32)),
    chunk_tokens=16, vocab_size=32_000)


def _stream_data(spec: LayoutSpec, tokens: int):
    from tests.support.service import streams_for

    return streams_for(spec, tokens, seed=7)


async def test_a_registered_gqa_layout_spills_and_restores_bit_exact(tmp_path):
    from kvtier import AsyncClient
    from tests.support.service import assert_streams_equal, running_server, tokens_for

    tokens = tokens_for(2 * GQA.chunk_tokens + 5)
    data = _stream_data(GQA, len(tokens))
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        layout_id = await kv.register_layout(GQA)
        assert layout_id == GQA.layout_id
        assert await kv.register_layout(layout_to_json(GQA)) == layout_id  # idempotent
        listed = {info.layout_id: info for info in await kv.layouts()}
        assert not listed[layout_id].builtin and listed[layout_id].replayer == "none"
        assert listed["deepseek-v3@b623b41edf7f24f0"].builtin
        await kv.spill("acme", "gqa", GQA.name, tokens, data, generation=1)
        restored = await kv.restore("acme", "gqa")
        assert restored.layout.layout_id == layout_id and not restored.replay_needed
        assert_streams_equal(restored.persistent, data)


def _huge(**changes) -> str:
    obj = json.loads(layout_to_json(GQA))
    obj.update(changes)
    return json.dumps(obj)


@pytest.mark.parametrize("text, error, why", [
    (_huge(name="deepseek-v3"), "InvalidRequest", "another shape"),
    (_huge(streams=[{"name": "k", "entry_shape": [1 << 20], "bits": 16, "layers": 64}]),
     "InvalidRequest", "a message can carry"),
    (_huge(streams=[{"name": f"s{i}", "entry_shape": [2], "bits": 16} for i in range(65)]),
     "InvalidRequest", "1 to 64 streams"),
    (_huge(streams=[{"name": "k", "entry_shape": [1, 1, 1, 1, 2], "bits": 16}]),
     "InvalidRequest", "at most 4 dimensions"),
    (_huge(chunk_tokens=1 << 17), "InvalidRequest", "at most 65536"),
    (_huge(notes="x" * (64 << 10)), "InvalidRequest", "over 65536 bytes"),
    (_huge(chunk_tokens=16.0), "InvalidRequest", "only integers"),
])
async def test_register_layout_refuses_what_could_grow_without_bound(tmp_path, text, error, why):
    import grpc

    from kvstore.format.errors import ERROR_CLASSES
    from kvtier import AsyncClient, RetryPolicy
    from tests.support.service import running_server

    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, retry=RetryPolicy(attempts=1)) as kv:
        with pytest.raises(ERROR_CLASSES[error], match=why) as caught:
            await kv.register_layout(text)
        assert isinstance(caught.value.__cause__, grpc.aio.AioRpcError)
        assert caught.value.__cause__.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not (server.servicer.config.data_dir / "layouts.json").exists()


@pytest.mark.parametrize("policy", ["none", "admin"])
async def test_register_layouts_policy_refuses_callers(tmp_path, policy):
    from kvstore.format.errors import PermissionDenied
    from kvtier import AsyncClient
    from tests.support.service import running_server

    async with running_server(tmp_path, register_layouts=policy) as (_, target), \
            AsyncClient(target) as kv:
        with pytest.raises(PermissionDenied, match=policy):
            await kv.register_layout(GQA)
        assert any(info.layout_id == "deepseek-v3@b623b41edf7f24f0"
                   for info in await kv.layouts())  # listing stays open


async def test_with_identities_only_admins_register_and_every_registration_is_audited(
        tmp_path):
    from kvstore.format.errors import PermissionDenied
    from tests.support.security import dev_set, secured_server

    certs = dev_set(tmp_path)
    spec = LayoutSpec("gqa-audited", GQA.streams, chunk_tokens=16)
    async with secured_server(tmp_path, certs) as (_, target):
        async with certs.client(target, "acme") as tenant:
            assert any(info.builtin for info in await tenant.layouts())
            with pytest.raises(PermissionDenied, match="admin credentials only"):
                await tenant.register_layout(spec)
        async with certs.client(target, "admin") as admin:
            assert await admin.register_layout(spec) == spec.layout_id
    lines = [json.loads(line) for line in certs.audit_lines()]
    layout = [line for line in lines if line["kind"] == "layout"]
    assert len(layout) == 1 and layout[0]["role"] == "admin"
    assert layout[0]["reason"] == f"{spec.layout_id} registered"
    assert any(line["kind"] == "permission_denied" and line["method"] == "RegisterLayout"
               for line in lines)


async def test_resume_of_a_layout_nothing_here_replays_is_failed_precondition(tmp_path):
    import grpc

    from kvstore.format.errors import ReplayUnavailable
    from kvtier import AsyncClient, RetryPolicy
    from tests.support.service import LAYOUT, assert_streams_equal, running_server, tokens_for

    flash = get_layout("deepseek-v4.1-flash")
    tokens = tokens_for(flash.chunk_tokens + 6)
    data = _stream_data(flash, len(tokens))
    bundled = _stream_data(LAYOUT, len(tokens))
    # The in-process backend replays the bundled model only; say this server's replayers
    # are transformers' to see a bundled session refused too.
    async with running_server(tmp_path, replayers=("transformers-deepseek-v4",)) as (
            _, target), AsyncClient(target, retry=RetryPolicy(attempts=1)) as kv:
        await kv.spill("acme", "flash", flash.name, tokens, data, generation=1)
        await kv.spill("acme", "bundled", LAYOUT.name, tokens, bundled, generation=1)
        for session, replayer in (("flash", "none"), ("bundled", "bundled")):
            with pytest.raises(ReplayUnavailable, match=f"its replayer: {replayer}") as caught:
                await kv.resume("acme", session)
            assert caught.value.__cause__.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "transformers-deepseek-v4" in str(caught.value)
        restored = await kv.restore("acme", "flash")  # Restore still works
        assert restored.replay_needed and not restored.replayed
        assert_streams_equal(restored.persistent, data)


async def test_resume_on_flash_like_with_the_default_replay_says_nothing_replays_it(tmp_path):
    from kvstore.format.errors import ReplayUnavailable
    from kvtier import AsyncClient, RetryPolicy
    from tests.support.service import running_server, tokens_for

    flash = get_layout("flash-4.1-like")  # was INVALID_ARGUMENT LayoutMismatch
    tokens = tokens_for(flash.chunk_tokens)
    async with running_server(tmp_path) as (_, target), \
            AsyncClient(target, retry=RetryPolicy(attempts=1)) as kv:
        await kv.spill("acme", "f", flash.name, tokens, _stream_data(flash, len(tokens)),
                       generation=1)
        with pytest.raises(ReplayUnavailable, match="this server's replayers: bundled"):
            await kv.resume("acme", "f")


CONFIGURED = LayoutSpec(  # listed in the server's config file, unknown to this process
    name="gqa-int8-configured",
    streams=(Stream("k", (8, 128), bits=8, group_size=128, layers=32),
             Stream("v", (8, 128), bits=8, group_size=128, layers=32)),
    chunk_tokens=16, vocab_size=32_000)
REGISTERED = LayoutSpec("gqa-registered", GQA.streams, chunk_tokens=32, vocab_size=32_000)


def _serve(data_dir, config):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--preset", "test", "--config",
         str(config), "--data-dir", str(data_dir), "--log-level", "WARNING"],
        cwd=Path(__file__).resolve().parents[2], env=env, stdout=subprocess.PIPE,
        text=True)
    line = process.stdout.readline()
    if not line.startswith("kvtier serving on "):
        process.kill()
        raise AssertionError(f"server did not start: {line!r}")
    return process, line.split()[-1]


def test_a_client_with_no_layouts_of_its_own_lists_spills_and_restores_and_they_persist(
        tmp_path):
    from kvstore.format.errors import UnknownLayout
    from kvtier import Client
    from tests.support.service import assert_streams_equal, tokens_for

    for spec in (CONFIGURED, REGISTERED):
        with pytest.raises(UnknownLayout):
            get_layout(spec.name)  # this process never registers them
    (tmp_path / "gqa.json").write_text(layout_to_json(CONFIGURED))
    config = tmp_path / "server.toml"
    config.write_text(f'layouts = ["{tmp_path / "gqa.json"}"]\n')
    tokens = tokens_for(40)
    data = _stream_data(CONFIGURED, len(tokens))
    process, target = _serve(tmp_path / "data", config)
    try:
        with Client(target) as kv:
            listed = {info.layout_id: info for info in kv.layouts()}
            assert CONFIGURED.layout_id in listed and not listed[CONFIGURED.layout_id].builtin
            assert listed[CONFIGURED.layout_id].spec == CONFIGURED
            kv.spill("acme", "s", CONFIGURED.name, tokens, data, generation=1)
            assert kv.register_layout(REGISTERED) == REGISTERED.layout_id
    finally:
        process.terminate()
        process.wait(30)
    stored = json.loads((tmp_path / "data" / "layouts.json").read_text())
    assert [layout_from_json(json.dumps(obj)) for obj in stored] == [REGISTERED]
    process, target = _serve(tmp_path / "data", config)
    try:
        with Client(target) as kv:  # a new client: knows the layouts only from the server
            restored = kv.restore("acme", "s")
            assert restored.layout == CONFIGURED
            assert_streams_equal(restored.persistent, data)
            assert REGISTERED.layout_id in {info.layout_id for info in kv.layouts()}
            with pytest.raises(InvalidRequest, match="another shape"):
                kv.register_layout(LayoutSpec(REGISTERED.name, GQA.streams, chunk_tokens=16))
    finally:
        process.terminate()
        process.wait(30)


async def test_kvtier_layouts_lists_a_servers_layouts(tmp_path):
    import asyncio
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kvtier import AsyncClient
    from tests.support.service import running_server

    spec = LayoutSpec("gqa-cli", GQA.streams, chunk_tokens=8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}

    def kvtier(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.cli", "layouts", *argv],
                              cwd=Path(__file__).resolve().parents[2], env=env,
                              capture_output=True, text=True, timeout=120)

    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.register_layout(spec)
        listed = await asyncio.to_thread(kvtier, "--server", target, "--json")
        table = await asyncio.to_thread(kvtier, "--server", target)
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert rows["gqa-cli"]["layout_id"] == spec.layout_id and not rows["gqa-cli"]["builtin"]
    assert rows["gqa-cli"]["layout_json"] == layout_to_json(spec)
    assert rows["gqa-cli"]["persistent_bytes_per_token"] == 131_072
    assert rows["kvtier-bundled"]["builtin"] and rows["kvtier-bundled"]["replayer"] == "bundled"
    assert "gqa-cli" in table.stdout
    down = kvtier("--server", "127.0.0.1:9")
    assert down.returncode == 1 and "kvtier layouts:" in down.stderr


def test_config_lists_layouts_inline_as_json_or_toml_tables(tmp_path):
    from services.server.config_load import load_config
    from services.server.layout_registry import ServerLayouts

    table = LayoutSpec("gqa-toml", GQA.streams, chunk_tokens=8)
    inline = LayoutSpec("gqa-inline", GQA.streams, chunk_tokens=4)
    path = tmp_path / "server.toml"
    path.write_text(
        f"layouts = ['{layout_to_json(inline)}', "
        '{ name = "gqa-toml", chunk_tokens = 8, streams = ['
        '{ name = "k", entry_shape = [8, 128], bits = 16, layers = 32 }, '
        '{ name = "v", entry_shape = [8, 128], bits = 16, layers = 32 }] }]\n'
        'register_layouts = "none"\n')
    config = load_config(path, env={})
    assert config.layout_policy == "none"
    ServerLayouts(config.layouts, tmp_path, config.layout_policy, config.max_message_bytes)
    assert get_layout(table.layout_id) == table and get_layout(inline.layout_id) == inline
    with pytest.raises(InvalidRequest, match="register_layouts must be one of"):
        load_config(env={}, overrides={"register_layouts": "everyone"})
    with pytest.raises(InvalidRequest, match="replayers must be some of"):
        load_config(env={}, overrides={"replayers": "none"})
    # A configured layout that does not hold stops the start, saying which entry.
    with pytest.raises(InvalidRequest, match="config layouts.*another shape"):
        ServerLayouts((_huge(name="deepseek-v3"),), tmp_path, "any", 64 << 20)
    with pytest.raises(InvalidRequest, match="cannot read"):
        ServerLayouts((str(tmp_path / "missing.json"),), tmp_path, "any", 64 << 20)


async def test_a_layout_claiming_a_replayer_that_cannot_rebuild_it_is_failed_precondition(
        tmp_path):
    """Refused at RegisterLayout; one stored by an older server is still served, and its
    Resume is FAILED_PRECONDITION (the replayer checks the layout), its Restore works."""
    from kvstore.format.errors import LayoutMismatch, ReplayUnavailable
    from kvtier import AsyncClient, RetryPolicy
    from tests.support.service import running_server, tokens_for

    flash = get_layout("flash-4.1-like")
    claimed = LayoutSpec("flash-claims-bundled", flash.streams, chunk_tokens=256,
                         window_tokens=128, vocab_size=256, replayer="bundled")
    tokens = tokens_for(claimed.chunk_tokens)
    async with running_server(tmp_path / "new") as (_, target), \
            AsyncClient(target, retry=RetryPolicy(attempts=1)) as kv:
        with pytest.raises(LayoutMismatch, match="not the cache of its model.*streams"):
            await kv.register_layout(claimed)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "layouts.json").write_text(f"[{layout_to_json(claimed)}]")
    async with running_server(tmp_path / "old") as (_, target), \
            AsyncClient(target, retry=RetryPolicy(attempts=1)) as kv:
        await kv.spill("acme", "c", claimed.layout_id, tokens,
                       _stream_data(claimed, len(tokens)), generation=1)
        with pytest.raises(ReplayUnavailable, match="bundled replayer here cannot rebuild"):
            await kv.resume("acme", "c")
        assert not (await kv.restore("acme", "c")).replayed
