"""Per-tenant quotas over a real server (kvstore.session.quota): each quota refuses with
RESOURCE_EXHAUSTED naming quota, limit and use; deleting makes room; usage survives a
restart; concurrent spills never overshoot; memory quotas push a tenant's own data down
before refusing; `kvtier stat --tenant` and the metrics show the usage, labels bounded."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import pytest

from kvstore.format.errors import (
    InvalidRequest,
    QuotaExceeded,
    SessionNotFound,
    TierFull,
    status_name,
)
from kvtier import AsyncClient
from services.cli.main import main as cli_main
from services.server.config_load import load_config
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    streams_for,
    tokens_for,
    window_for,
)

N = 2 * LAYOUT.chunk_tokens + 40  # two chunks and a tail
TOKENS = tokens_for(N)
KV = streams_for(LAYOUT, N, seed=3)


def _quota(**tables):
    return {"quota": tables}


async def _spill(kv, tenant, sid, *, generation=1, seed=None, **options):
    tokens = TOKENS if seed is None else tokens_for(N, seed=seed)
    streams = KV if seed is None else streams_for(LAYOUT, N, seed=seed)
    return await kv.spill(tenant, sid, LAYOUT.name, tokens, streams, generation=generation,
                          **options)


def _refused(info, quota, tenant, limit, use):
    exc = info.value
    assert type(exc) is QuotaExceeded and isinstance(exc, TierFull)
    assert status_name(exc) == "RESOURCE_EXHAUSTED"
    assert f"quota {quota} for tenant {tenant}: limit {limit}, in use {use}" in str(exc)


async def _stored(server, tenant):
    return sum(m.stored_bytes for m in await server.manager.list_sessions(tenant))


async def test_sessions_quota_refuses_the_next_session_until_one_is_deleted(tmp_path):
    config = _quota(default={"sessions": 10}, acme={"sessions": 2})
    async with running_server(tmp_path, **config) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "s1")
        await _spill(kv, "acme", "s2")
        with pytest.raises(QuotaExceeded) as info:
            await _spill(kv, "acme", "s3")
        _refused(info, "sessions", "acme", 2, 2)
        assert "this spill needs 1 more" in str(info.value)
        with pytest.raises(SessionNotFound):  # nothing of the refused spill was stored
            await server.manager.get_manifest("acme", "s3")
        await _spill(kv, "acme", "s1", generation=2)  # a new generation is no new session
        for sid in ("b1", "b2", "b3"):  # other tenants: the default's 10
            await _spill(kv, "beta", sid)
        await kv.delete("acme", "s2")
        await _spill(kv, "acme", "s3")  # room again
        assert server.manager.tenant_usage("acme").usage.sessions == 2


async def test_durable_bytes_counts_each_session_once_and_frees_on_delete(tmp_path):
    async with running_server(tmp_path / "probe") as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "probe")
        size = await _stored(server, "acme")
    limit = 2 * size + size // 2
    async with running_server(tmp_path / "data", **_quota(acme={"durable_bytes": limit})) \
            as (server, target), AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "s1")
        second = await _spill(kv, "acme", "s2")  # the same bytes: deduped, counted again
        assert second.chunks_deduped == 2
        assert server.manager.tenant_usage("acme").usage.durable_bytes == 2 * size
        with pytest.raises(QuotaExceeded) as info:
            await _spill(kv, "acme", "s3")
        _refused(info, "durable_bytes", "acme", limit, 2 * size)
        assert f"this spill needs {size} more" in str(info.value)
        await kv.delete("acme", "s1")
        assert server.manager.tenant_usage("acme").usage.durable_bytes == size
        await _spill(kv, "acme", "s3")
        assert server.manager.tenant_usage("acme").usage.durable_bytes == 2 * size


async def test_usage_is_recomputed_after_a_restart(tmp_path):
    config = _quota(acme={"sessions": 2})
    async with running_server(tmp_path, **config) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "s1", seed=1, ack="durable")
        await _spill(kv, "acme", "s2", seed=2, ack="durable")
        before = server.manager.tenant_usage("acme").usage
    assert before.sessions == 2 and before.durable_bytes > 0
    async with running_server(tmp_path, **config) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        after = server.manager.tenant_usage("acme").usage
        assert (after.sessions, after.durable_bytes) == (before.sessions, before.durable_bytes)
        assert after.durable_bytes == await _stored(server, "acme")
        with pytest.raises(QuotaExceeded) as info:
            await _spill(kv, "acme", "s3", seed=3)
        _refused(info, "sessions", "acme", 2, 2)
        await kv.delete("acme", "s1")
        await _spill(kv, "acme", "s3", seed=3)


async def test_concurrent_spills_never_overshoot(tmp_path):
    async with running_server(tmp_path / "probe") as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "probe")
        size = await _stored(server, "acme")
    config = _quota(acme={"sessions": 5}, beta={"durable_bytes": 3 * size})
    async with running_server(tmp_path / "data", **config) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        for tenant, admitted in (("acme", 5), ("beta", 3)):
            results = await asyncio.gather(
                *(_spill(kv, tenant, f"s{i}") for i in range(12)), return_exceptions=True)
            refused = [r for r in results if isinstance(r, QuotaExceeded)]
            assert len(refused) == 12 - admitted, results
            assert len(await server.manager.list_sessions(tenant)) == admitted
        assert server.manager.tenant_usage("beta").usage.durable_bytes == 3 * size


async def test_memory_quota_moves_the_tenants_own_data_down_rather_than_refusing(tmp_path):
    async with running_server(tmp_path / "probe") as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "probe", seed=1)
        chunk_bytes = sum((await server.manager.get_manifest("acme", "probe")).chunk_sizes)
    limit = chunk_bytes + chunk_bytes // 2  # one session's chunks, not two
    async with running_server(tmp_path / "data", **_quota(acme={"memory_bytes": limit})) \
            as (server, target), AsyncClient(target, shared_memory=False) as kv:
        manager = server.manager
        for index in range(4):
            await _spill(kv, "acme", f"s{index}", seed=index + 1)
            assert manager.tenant_usage("acme").usage.memory_bytes <= limit
        in_host = {}  # session -> bytes of its chunks in the host tier
        for sid in ("s0", "s1", "s2", "s3"):
            manifest = await manager.get_manifest("acme", sid)
            in_host[sid] = sum(size for key, size in zip(manifest.chunk_keys,
                                                         manifest.chunk_sizes, strict=True)
                               if "host" in manager.where(key))
        assert in_host["s3"] == chunk_bytes  # the newest is hot, older ones went down
        assert manager.tenant_usage("acme").usage.memory_bytes == sum(in_host.values())
        assert sum(in_host.values()) <= limit
        for index in range(4):
            got = await kv.restore("acme", f"s{index}")
            assert_streams_equal(got.persistent, streams_for(LAYOUT, N, seed=index + 1))
        # another tenant is not held to acme's quota
        await _spill(kv, "beta", "b", seed=9)
        assert manager.tenant_usage("beta").usage.memory_bytes == chunk_bytes


async def test_memory_quota_counts_windows_and_refuses_without_a_lower_tier(tmp_path):
    window = window_for(LAYOUT, N)
    async with running_server(tmp_path / "probe") as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "probe", window=window)
        manifest = await server.manager.get_manifest("acme", "probe")
        use = server.manager.tenant_usage("acme").usage.memory_bytes
        assert manifest.window_key is not None and use > sum(manifest.chunk_sizes)
    memory_only = {"disk_bytes": 0, "object_bytes": 0}
    async with running_server(tmp_path / "data", **memory_only,
                              **_quota(acme={"memory_bytes": use + use // 2})) \
            as (server, target), AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "s1", window=window)
        assert server.manager.tenant_usage("acme").usage.memory_bytes == use
        with pytest.raises(QuotaExceeded) as info:
            await _spill(kv, "acme", "s2", seed=5, window=window)
        _refused(info, "memory_bytes", "acme", use + use // 2, use)
        await kv.delete("acme", "s1")
        assert server.manager.tenant_usage("acme").usage.memory_bytes == 0
        await _spill(kv, "acme", "s2", seed=5, window=window)


async def test_stat_tenant_prints_the_usage_against_the_limits(tmp_path, capsys):
    config = _quota(default={"sessions": 7}, acme={"durable_bytes": 10_000_000})
    async with running_server(tmp_path, **config) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await _spill(kv, "acme", "s1")
        durable = server.manager.tenant_usage("acme").usage.durable_bytes
        reply = await kv.stat(usage_of="acme")
        usage = reply.tenant_usage
        assert (usage.tenant, usage.sessions, usage.durable_bytes) == ("acme", 1, durable)
        assert usage.sessions_limit == 7 and usage.durable_bytes_limit == 10_000_000
        assert usage.memory_bytes_limit is None  # unlimited
        assert (await kv.stat()).tenant_usage is None
        code = await asyncio.to_thread(cli_main, ["stat", "--server", target, "--tenant", "acme"])
        out = capsys.readouterr().out
        assert code == 0
        assert "tenant acme" in out
        assert re.search(r"sessions\s+1\s+7\n", out)
        assert re.search(r"durable_bytes\s+\S+ \S+\s+9\.5 MiB\n", out)
        assert re.search(r"memory_bytes\s+\S+ \S+\s+unlimited\n", out)
        code = await asyncio.to_thread(
            cli_main, ["stat", "--server", target, "--tenant", "acme", "--json"])
        got = json.loads(capsys.readouterr().out)["tenantUsage"]
        assert got["sessions"] == 1 and got["durableBytes"] == durable


async def test_metrics_label_only_tenants_with_a_table(tmp_path):
    config = _quota(acme={"sessions": 1})
    async with running_server(tmp_path, metrics_port=0, **config) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        port = server.start_metrics(0, "127.0.0.1")
        await _spill(kv, "acme", "s1")
        with pytest.raises(QuotaExceeded):
            await _spill(kv, "acme", "s2")
        for tenant in ("beta", "gamma", "delta"):
            await _spill(kv, tenant, "s1")
        await kv.stat()  # refreshes the snapshot the endpoint exports
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
        samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                   for line in text.splitlines() if line.startswith("kvtier_")}
        assert samples['kvtier_tenant_sessions{tenant="acme"}'] == 1
        assert samples['kvtier_tenant_sessions{tenant="other"}'] == 3
        durable = server.manager.tenant_usage("acme").usage.durable_bytes
        assert samples['kvtier_tenant_bytes{kind="durable",tenant="acme"}'] == durable
        assert samples['kvtier_tenant_bytes{kind="durable",tenant="other"}'] == 3 * durable
        assert samples['kvtier_quota_rejections_total{quota="sessions",tenant="acme"}'] == 1
        assert samples['kvtier_quota_limit{quota="sessions",tenant="acme"}'] == 1
        labels = set(re.findall(r'tenant="([^"]*)"', text))
        assert labels == {"acme", "other"}


def test_config_quota_tables(tmp_path, capsys):
    path = tmp_path / "kvtier.toml"
    path.write_text('[quota.default]\nsessions = 200\nmemory_bytes = "1GiB"\n'
                    '[quota.acme]\ndurable_bytes = "2MiB"\n')
    config = load_config(path, env={})
    assert dict(config.quota["acme"]) == {"durable_bytes": 2 << 20}
    with pytest.raises(TypeError):
        config.quota["acme"]["sessions"] = 1  # frozen
    from kvstore.session.quota import Quotas

    acme = Quotas.from_tables(config.quota).limits("acme")
    assert (acme.sessions, acme.memory_bytes, acme.durable_bytes) == (200, 1 << 30, 2 << 20)
    env = load_config(env={"KVTIER_QUOTA": "default.sessions=3;acme.memory_bytes=1KiB"})
    assert dict(env.quota["acme"]) == {"memory_bytes": 1024}
    assert cli_main(["serve", "--print-config", "--config", str(path),
                     "--listen", "127.0.0.1:0"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["quota"] == {"default": {"sessions": 200, "memory_bytes": 1 << 30},
                              "acme": {"durable_bytes": 2 << 20}}
    for text, words in (("[quota.default]\nsession = 1\n", "unknown keys ['session']"),
                        ("[quota.acme]\nsessions = -1\n", "quota.acme.sessions"),
                        ("[quota.other]\nsessions = 1\n", "quota.other"),
                        ("[quota.acme]\nsessions = true\n", "quota.acme.sessions")):
        path.write_text(text)
        with pytest.raises(InvalidRequest, match=re.escape(words)):
            load_config(path, env={})
