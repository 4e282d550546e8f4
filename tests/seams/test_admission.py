"""Admission at the crossings, over real servers: every RPC that creates a session goes
through the one reservation path (parallel forks, forks racing spills: every quota
holds, and the count after a restart is the count before); registered layouts that
claim a replayer must be that replayer's model exactly (nothing they say can make a
Resume fail with INTERNAL); and on a real full tmpfs the disk tier's reserve is kept by
every write, so every Delete succeeds, space comes back and spills work again, also
after a restart."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path

import pytest

from kvstore.format.errors import (
    InvalidRequest,
    KVTierError,
    LayoutMismatch,
    QuotaExceeded,
    TierFull,
    status_name,
)
from kvstore.format.layout import ANY_TOKEN_ID, LayoutSpec, layout_to_json
from kvstore.format.registry import get_layout
from kvstore.tiers.disk.headroom import DEFAULT_RESERVE_BYTES
from kvtier import AsyncClient, Client, RetryPolicy
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    serve_child,
    stop_child,
    streams_for,
    tokens_for,
    window_for,
)

N = 2 * LAYOUT.chunk_tokens + 40  # two chunks and a tail


async def _spill(kv, tenant, sid, *, seed=0, tokens=N, **options):
    return await kv.spill(tenant, sid, LAYOUT.name, tokens_for(tokens, seed=seed),
                          streams_for(LAYOUT, tokens, seed=seed), generation=1, **options)


def _sessions(results):
    admitted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    others = [r for r in results if isinstance(r, BaseException)
              and not isinstance(r, QuotaExceeded)]
    assert not others, others
    return admitted, refused


# -- one reservation path: forks and spills --


async def test_parallel_forks_hold_the_sessions_quota_also_after_a_restart(tmp_path):
    config = {"quota": {"acme": {"sessions": 3}}}
    async with running_server(tmp_path, **config) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "src", ack="durable")
        results = await asyncio.gather(
            *(kv.fork("acme", "src", f"f{i}", upto_tokens=N) for i in range(30)),
            return_exceptions=True)
        admitted, refused = _sessions(results)
        assert (len(admitted), len(refused)) == (2, 28)
        assert "quota sessions for tenant acme: limit 3" in str(refused[0])
        assert len(await server.manager.list_sessions("acme")) == 3
        before = server.manager.tenant_usage("acme").usage
        assert before.sessions == 3
    async with running_server(tmp_path, **config) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        after = server.manager.tenant_usage("acme").usage
        assert (after.sessions, after.durable_bytes) == (before.sessions, before.durable_bytes)
        assert len(await server.manager.list_sessions("acme")) == 3
        with pytest.raises(QuotaExceeded):
            await kv.fork("acme", "src", "late", upto_tokens=N)


async def test_spills_racing_forks_hold_every_quota(tmp_path):
    async with running_server(tmp_path / "probe") as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "probe")
        size = server.manager.tenant_usage("acme").usage.durable_bytes
    config = {"quota": {"acme": {"sessions": 6}, "beta": {"durable_bytes": 4 * size}}}
    async with running_server(tmp_path / "data", **config) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        for tenant, limit in (("acme", 6), ("beta", 4)):
            await _spill(kv, tenant, "src")
            calls = []
            for i in range(12):
                calls.append(kv.fork(tenant, "src", f"f{i}", upto_tokens=N))
                calls.append(_spill(kv, tenant, f"s{i}", seed=i + 1))
            admitted, refused = _sessions(await asyncio.gather(*calls, return_exceptions=True))
            assert len(admitted) == limit - 1 and len(refused) == 24 - (limit - 1)
            assert len(await server.manager.list_sessions(tenant)) == limit
        use = server.manager.tenant_usage("beta").usage
        assert use.durable_bytes == 4 * size
        # forks at a chunk boundary cost one chunk: the bytes quota holds them too
        await kv.delete("beta", "src")
        source = (await server.manager.list_sessions("beta"))[0]
        chunk = source.chunk_sizes[0]
        room = 4 * size - server.manager.tenant_usage("beta").usage.durable_bytes
        results = await asyncio.gather(
            *(kv.fork("beta", source.session_id, f"p{i}", upto_tokens=LAYOUT.chunk_tokens)
              for i in range(8)), return_exceptions=True)
        admitted, _ = _sessions(results)
        assert len(admitted) == room // chunk
        assert server.manager.tenant_usage("beta").usage.durable_bytes <= 4 * size


async def test_forks_hold_the_memory_quota(tmp_path):
    """A fork's chunks held in memory count for it as for any session, and so does the
    window it copies: past the quota the tenant's own data moves down first, and the
    fork's window is left out (its Resume replays it) rather than the quota passed."""
    window = window_for(LAYOUT, N)
    async with running_server(tmp_path / "probe") as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "probe", window=window)
        use = server.manager.tenant_usage("acme").usage.memory_bytes
    limit = use + use // 2  # one session with its window in memory, not two
    async with running_server(tmp_path / "data", quota={"acme": {"memory_bytes": limit}}) \
            as (server, target), AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "src", window=window)
        assert server.manager.tenant_usage("acme").usage.memory_bytes == use
        results = await asyncio.gather(
            *(kv.fork("acme", "src", f"f{i}", upto_tokens=N) for i in range(6)),
            return_exceptions=True)
        admitted, _ = _sessions(results)
        assert admitted
        assert server.manager.tenant_usage("acme").usage.memory_bytes <= limit
        for i, result in enumerate(results):
            if not isinstance(result, BaseException):
                got = await kv.restore("acme", f"f{i}", want_window=False)
                assert_streams_equal(got.persistent, streams_for(LAYOUT, N, seed=0))


async def test_a_rebuilt_window_is_kept_only_within_the_memory_quota(tmp_path):
    window = window_for(LAYOUT, N)
    async with running_server(tmp_path / "probe") as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "probe")
        chunks = server.manager.tenant_usage("acme").usage.memory_bytes
        await kv.delete("acme", "probe")
        await _spill(kv, "acme", "probe", window=window)
        with_window = server.manager.tenant_usage("acme").usage.memory_bytes
    limit = chunks + (with_window - chunks) // 2  # the chunks, not the window too
    async with running_server(tmp_path / "data", quota={"acme": {"memory_bytes": limit}}) \
            as (server, target), AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "s")
        resumed = await kv.resume("acme", "s")  # replayed: its window is not kept
        assert resumed.replayed and resumed.window
        assert server.manager.tenant_usage("acme").usage.memory_bytes <= limit
        assert (await server.manager.get_manifest("acme", "s")).window_key is None


# -- registered layouts against the replayer they claim --


def _bundled(**changes) -> LayoutSpec:
    return dataclasses.replace(get_layout("kvtier-bundled"), **{"name": "bundled-copy",
                                                                **changes})


HOSTILE = {
    "vocab_size=2^32": dict(vocab_size=ANY_TOKEN_ID),
    "vocab_size=257": dict(vocab_size=257),
    "window_tokens=4096": dict(window_tokens=4096),
    "layer_modes reversed": dict(layer_modes=tuple(reversed(
        get_layout("kvtier-bundled").layer_modes))),
}


@pytest.mark.parametrize("changes", HOSTILE.values(), ids=HOSTILE)
def test_the_bundled_replayer_refuses_a_layout_of_another_cache(changes):
    from model.config import ModelConfig
    from replay.state_codec import check_spec

    check_spec(ModelConfig(), _bundled())  # the same cache under another name
    with pytest.raises(LayoutMismatch):
        check_spec(ModelConfig(), _bundled(**changes))


async def test_register_layout_refuses_a_copy_of_the_bundled_layout_with_another_vocabulary(
        tmp_path):
    hostile = _bundled(vocab_size=ANY_TOKEN_ID)
    tokens = tokens_for(LAYOUT.chunk_tokens + 8)
    tokens[-1] = 300  # past the bundled model's 256-token vocabulary
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, retry=RetryPolicy(attempts=1), shared_memory=False) as kv:
        await kv.register_layout(_bundled(name="bundled-same"))  # its cache, another name
        with pytest.raises(KVTierError) as info:
            await kv.register_layout(hostile)
            # on a server that took it: the spill is accepted, the Resume must not be INTERNAL
            await kv.spill("acme", "v", hostile.name, tokens,
                           streams_for(hostile, len(tokens)), generation=1)
            await kv.resume("acme", "v")
        assert status_name(info.value) == "INVALID_ARGUMENT", info.value
        assert "vocab_size" in str(info.value) and "bundled" in str(info.value)
        assert str(tmp_path) not in str(info.value)
        for i, changes in enumerate(HOSTILE.values()):
            # LayoutMismatch; a 4096-token window is refused first, past the message limit
            with pytest.raises(LayoutMismatch if "window_tokens" not in changes
                               else InvalidRequest):
                await kv.register_layout(_bundled(name=f"hostile-{i}", **changes))
        names = {info.layout_id.partition("@")[0] for info in await kv.layouts()}
        assert "bundled-same" in names and "bundled-copy" not in names
        assert not {name for name in names if name.startswith("hostile-")}


async def test_a_configured_layout_claiming_the_bundled_replayer_must_be_its_cache(tmp_path):
    hostile = layout_to_json(_bundled(name="cfg-copy", vocab_size=ANY_TOKEN_ID))
    with pytest.raises(LayoutMismatch, match="config layouts.*vocab_size"):
        async with running_server(tmp_path, layouts=(hostile,)):
            pass


async def test_a_layout_claiming_the_servers_transformers_model_must_be_its_cache(tmp_path):
    pytest.importorskip("transformers")
    from bench.hf import tiny_config
    from kvstore.format.hf.model_layouts import deepseek_v4_layout

    config = tiny_config()
    config_json = tmp_path / "config.json"
    config.to_json_file(config_json)
    own = deepseek_v4_layout(config, 4)
    async with running_server(tmp_path / "data", replay_hf_model=str(config_json)) \
            as (_, target), AsyncClient(target, retry=RetryPolicy(attempts=1)) as kv:
        await kv.register_layout(dataclasses.replace(own, name="v4-same"))
        with pytest.raises(LayoutMismatch, match="not the cache of its model here.*vocab"):
            await kv.register_layout(dataclasses.replace(own, name="v4-vocab",
                                                         vocab_size=ANY_TOKEN_ID))


# -- a real full medium --

FULL_CONFIG = """
host_bytes = "2MiB"
disk_bytes = "1GiB"
object_bytes = 0
disk_segment_bytes = "1MiB"
disk_reclaim_dead_fraction = 0.5
disk_reclaim_interval_s = 0.05
"""
BIG = 16 * LAYOUT.chunk_tokens  # sixteen chunks, ~300 KB on disk
SMALL = 3  # no whole chunk: a manifest (its tail inside) and nothing else
SLACK = 64 << 10  # what the medium's block rounding and LMDB's pages may take past a check


def _free(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def _fill(kv: Client, prefix: str, tokens: int, ack: str, limit: int) -> list[str]:
    """Spill sessions until the medium refuses 8 in a row; their names."""
    stored, refused = [], 0
    for n in range(limit):
        if refused >= 8:
            return stored
        try:
            kv.spill("acme", f"{prefix}{n}", LAYOUT.name, tokens_for(tokens, seed=n),
                     streams_for(LAYOUT, tokens, seed=n), generation=1, ack=ack)
            stored.append(f"{prefix}{n}")
            refused = 0
        except TierFull:
            refused += 1
    pytest.fail(f"{limit} spills of {tokens} tokens never filled the medium")


def _spill_when_room(kv: Client, sid: str, attempts: int = 300) -> None:
    for _ in range(attempts):
        try:
            return kv.spill("acme", sid, LAYOUT.name, tokens_for(BIG, seed=7),
                            streams_for(LAYOUT, BIG, seed=7), generation=1, ack="durable")
        except TierFull:
            time.sleep(0.1)
    pytest.fail(f"spill {sid} still refused after the deletes: no space came back")


async def test_the_disk_tier_keeps_its_reserve_for_every_write_that_stores(tmpfs_factory):
    """Values, overwrites (a new record each) and metadata puts stop at the reserve;
    metadata deletes and value deletes still run there; a rewrite takes half of it."""
    from kvstore.tiers.disk import DiskTier

    medium = tmpfs_factory(8)
    reserve = 2 << 20
    tier = DiskTier(medium, 1 << 30, segment_bytes=256 << 10, reserve_bytes=reserve,
                    reclaim_dead_fraction=0.5, reclaim_interval_s=3600)
    try:
        value = os.urandom(32 << 10)
        stored = 0
        with pytest.raises(TierFull):
            while True:
                await tier.put(f"v{stored}", value)
                stored += 1
        with pytest.raises(TierFull):  # an overwrite is a record of its own too
            for _ in range(64):
                await tier.put("v0", value)
        with pytest.raises(TierFull):
            for i in range(64):
                await tier.meta.commit({f"m/{i}": value})
        assert _free(medium) >= reserve - SLACK, "the reserve was eaten"
        for i in range(1, stored, 2):  # every sealed segment half dead
            await tier.delete(f"v{i}")
        await tier.meta.commit({f"m/{i}": None for i in range(64)})
        full = _free(medium)
        assert await tier.reclaimer.run_once() > 0  # fits its runs to the room it has
        assert _free(medium) > full
        for i in range(0, stored, 2):
            await tier.delete(f"v{i}")
        assert await tier.count() == 0
    finally:
        await tier.close()


# the retained case repeats the freed one with retention's shedding on top: slow only
@pytest.mark.parametrize("retain", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["freed", "retained"])
def test_a_full_tmpfs_keeps_its_reserve_and_every_delete_succeeds(tmpfs_factory, tmp_path,
                                                                  retain):
    """Deleted sessions' chunks are freed at once, or (``retain``) kept as cache until a
    spill needs their room: space comes back either way."""
    medium = tmpfs_factory(20)
    config = tmp_path / "kvtier.toml"
    config.write_text(FULL_CONFIG + f"retain_unreferenced = {str(retain).lower()}\n")
    process, target = serve_child(medium, config, "CRITICAL")
    try:
        with Client(target, retry=RetryPolicy(attempts=1)) as kv:
            big = _fill(kv, "b", BIG, "durable", 200)
            # manifests only, memory acks: none of these writes may eat the reserve either
            # (none may fit: the refused big spills' chunks can leave the medium right at its
            # reserve until reclamation frees them, and then every small write is refused too)
            small = _fill(kv, "t", SMALL, "memory", 4000)
            assert len(big) > 4
            with pytest.raises(TierFull):  # layouts.json lies on the same medium
                for i in range(200):
                    kv.register_layout(dataclasses.replace(LAYOUT, name=f"full-{retain}-{i}",
                                                           replayer="none", replay_tokens=0))
            assert _free(medium) >= DEFAULT_RESERVE_BYTES - SLACK, "the reserve was eaten"
            full = _free(medium)
            names = [*small, *big]
            failed = []
            for sid in names[:40]:
                try:
                    kv.delete("acme", sid)
                except KVTierError as exc:
                    failed.append((sid, exc))
            assert not failed, failed[:3]
            if not retain:
                for _ in range(300):  # reclamation frees the dead segments online
                    if _free(medium) > full + 1024 * 1024:
                        break
                    time.sleep(0.1)
                else:
                    pytest.fail(f"free space stayed at {_free(medium)} after the deletes")
            _spill_when_room(kv, "after")
            assert_streams_equal(kv.restore("acme", "after", want_window=False).persistent,
                                 streams_for(LAYOUT, BIG, seed=7))
    finally:
        stop_child(process)
    process, target = serve_child(medium, config, "CRITICAL")
    try:
        with Client(target, retry=RetryPolicy(attempts=1)) as kv:
            kept = big[-1]
            assert_streams_equal(kv.restore("acme", kept, want_window=False).persistent,
                                 streams_for(LAYOUT, BIG, seed=int(kept[1:])))
            _fill(kv, "c", BIG, "durable", 200)  # full again, after the restart
            assert _free(medium) >= DEFAULT_RESERVE_BYTES - SLACK, "the reserve was eaten"
            for sid in names[40:]:
                kv.delete("acme", sid)
            _spill_when_room(kv, "after-restart")
    finally:
        stop_child(process)
