"""The fleet's and the remote dependencies' metrics (services.server.remote_metrics) move
with real calls: a fleet server over moto's S3 server and a real redis-server, two real
stores racing one manifest, a real sweep and ``kvtier fleet-gc --metrics-file``, and S3
and Redis endpoints where nothing listens."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvstore.fleet.gc import collect
from kvstore.format.errors import StaleGeneration, TierUnavailable
from kvstore.session.manifest import manifest_key
from kvstore.tiers.object import ObjectTier, ObjectTierConfig
from kvstore.tiers.redis import RedisTier, RedisTierConfig
from kvtier import AsyncClient
from services.cli.main import main
from services.server.config_load import load_config
from services.server.remote_metrics import RemoteMetrics, observe_store
from services.server.server import create_server
from tests.support.fleet import FAST, fleet_nodes, kept_and_dropped, shared_config
from tests.support.manager import make_session, random_tokens
from tests.support.servers import free_port
from tests.support.service import LAYOUT, streams_for, tokens_for


def observed(*holders) -> CollectorRegistry:
    """A registry of RemoteMetrics observing these stores (TierManagers)."""
    registry = CollectorRegistry()
    metrics = RemoteMetrics(registry)
    for manager in holders:
        observe_store(manager.tiers, manager.meta, metrics)
    return registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def session(i: int) -> dict:
    return make_session(random_tokens(64, i), seed=i, window=False, tenant="acme")


async def test_a_fleet_server_times_its_s3_and_redis_calls_and_counts_its_cas_and_gate(
        tmp_path, s3_server, s3_bucket, s3_credentials, redis_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    config = load_config(preset="test", env={}, overrides={
        "data_dir": tmp_path / "a", "metadata": "shared", "node_id": "a",
        "s3_endpoint": s3_server, "s3_bucket": s3_bucket, "redis_url": redis_server,
        "s3_region": s3_credentials["region_name"]})
    server, port = await create_server(config)
    try:
        tokens = LAYOUT.chunk_tokens + 20
        async with AsyncClient(f"127.0.0.1:{port}") as kv:
            for i in range(2):
                await kv.spill("acme", f"s{i}", LAYOUT.name, tokens_for(tokens, seed=i),
                               streams_for(LAYOUT, tokens, seed=i), generation=1,
                               ack="durable")
            await kv.restore("acme", "s0")
        count = lambda name, **labels: value(server.metrics.registry, name, **labels)  # noqa: E731
        assert count("kvtier_object_request_seconds_count", op="put") >= 2  # manifests
        assert count("kvtier_object_request_seconds_count", op="list") >= 1  # at open
        assert count("kvtier_redis_request_seconds_count", op="set") >= 1
        assert count("kvtier_fleet_cas_total", result="won") == 2  # one per generation
        assert count("kvtier_fleet_cas_total", result="conflict") == 0
        assert count("kvtier_fleet_gate_wait_seconds_count") == 2  # each commit's gate
        assert count("kvtier_fleet_gc_runs_total", result="ok") == 0  # servers run none
        assert count("kvtier_object_errors_total", op="put", kind="unavailable") == 0
    finally:
        await server.stop(0.5)


async def test_a_manifest_written_since_this_node_read_it_counts_one_conflict(node_config):
    async with fleet_nodes(node_config) as open_node:
        a, b = await open_node("a"), await open_node("b")
        registry_a, registry_b = observed(a), observed(b)
        await a.spill("acme", "s1", generation=1, ack="durable", **session(1))
        key = manifest_key("acme", "s1")
        first = await b.meta.get(key)  # b's view: generation 1
        await a.spill("acme", "s1", generation=2, ack="durable", **session(2))
        with pytest.raises(StaleGeneration):
            await b.meta.commit({key: first})  # a CAS on the ETag b read
        assert value(registry_b, "kvtier_fleet_cas_total", result="conflict") == 1
        assert value(registry_b, "kvtier_fleet_cas_total", result="won") == 0
        assert value(registry_a, "kvtier_fleet_cas_total", result="won") == 2
        assert value(registry_a, "kvtier_fleet_cas_total", result="conflict") == 0
        await b.meta.get(key)  # read again: the next CAS wins
        await b.meta.commit({key: await b.meta.get(key)})
        assert value(registry_b, "kvtier_fleet_cas_total", result="won") == 1
        assert b.meta.cas_results == {"conflict": 1, "won": 1}


async def test_a_sweep_counts_its_run_and_deletions(node_config):
    async with fleet_nodes(node_config) as open_node:
        a = await open_node("a")
        kept, dropped = session(1), session(2)
        await a.spill("acme", "kept", generation=1, ack="durable", **kept)
        await a.spill("acme", "dropped", generation=1, ack="durable", **dropped)
        await a.delete("acme", "dropped")
        registry = observed(a)
        await collect(a.meta, FAST, dry_run=True)  # counts nothing
        assert value(registry, "kvtier_fleet_gc_runs_total", result="ok") == 0
        report = await collect(a.meta, FAST)
        assert report.deleted == len(dropped["chunks"]) > 0
        assert value(registry, "kvtier_fleet_gc_runs_total", result="ok") == 1
        assert value(registry, "kvtier_fleet_gc_runs_total", result="error") == 0
        assert value(registry, "kvtier_fleet_gc_deleted_total") == report.deleted


def test_fleet_gc_adds_each_run_to_its_metrics_file(tmp_path, s3_server, s3_bucket,
                                                    s3_credentials, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    region = s3_credentials["region_name"]
    dropped = session(2)

    async def setup() -> None:
        from services.server.store import open_manager

        node = await open_manager(shared_config(tmp_path, s3_server, s3_bucket, region, "a"))
        await kept_and_dropped(node, session(1), dropped)

    asyncio.run(setup())
    config = tmp_path / "gc.toml"
    config.write_text("\n".join(f'{k} = "{v}"' for k, v in dict(
        data_dir=tmp_path / "gc", metadata="shared", node_id="gc", s3_bucket=s3_bucket,
        s3_endpoint=s3_server, s3_region=region).items()) + "\nfleet_gc_grace_s = 0.0\n"
        "fleet_retain_s = 0.0\n")
    path = tmp_path / "kvtier_fleet_gc.prom"
    sweep = ["fleet-gc", "--config", str(config), "--margin-s", "0.2", "--spill-bound-s",
             "0.5", "--metrics-file", str(path), "--json"]
    for _ in range(2):
        assert main(sweep) == 0
    assert '"result": "ok"' in capsys.readouterr().out
    samples = {(s.name, s.labels.get("result", "")): s.value
               for family in text_string_to_metric_families(path.read_text())
               for s in family.samples}
    assert samples[("kvtier_fleet_gc_runs_total", "ok")] == 2
    assert samples[("kvtier_fleet_gc_runs_total", "error")] == 0
    assert samples[("kvtier_fleet_gc_deleted_total", "")] == len(dropped["chunks"])
    assert main([*sweep[:-1], "--dry-run"]) == 0  # a dry run is not a run
    unreachable = tmp_path / "down.toml"
    unreachable.write_text(config.read_text().replace(s3_server,
                                                      f"http://127.0.0.1:{free_port()}"))
    assert main(["fleet-gc", "--config", str(unreachable), "--metrics-file", str(path)]) == 4
    samples = {(s.name, s.labels.get("result", "")): s.value
               for family in text_string_to_metric_families(path.read_text())
               for s in family.samples}
    assert samples[("kvtier_fleet_gc_runs_total", "ok")] == 2
    assert samples[("kvtier_fleet_gc_runs_total", "error")] == 1


async def test_calls_to_an_s3_endpoint_that_does_not_answer_are_errors_by_op_and_kind(
        tmp_path, opened):
    tier = opened.adopt(ObjectTier("s3://bucket/p", 1 << 20, ObjectTierConfig(
        endpoint_url=f"http://127.0.0.1:{free_port()}", region_name="us-east-1",
        aws_access_key_id="k", aws_secret_access_key="s", max_attempts=1)))
    registry = CollectorRegistry()
    tier.remote.observer = RemoteMetrics(registry)
    for _ in range(2):  # its first listing refused, then the open breaker fails it fast
        with pytest.raises(TierUnavailable):
            await tier.put("t/" + "ab" * 16, b"x")
    assert value(registry, "kvtier_object_errors_total", op="list", kind="unavailable") == 2
    assert value(registry, "kvtier_object_request_seconds_count", op="list") == 2
    assert value(registry, "kvtier_object_request_seconds_count", op="put") == 0


async def test_an_s3_call_past_its_deadline_is_a_timeout(opened, hung_server):
    tier = opened.adopt(ObjectTier("s3://bucket/p", 1 << 20, ObjectTierConfig(
        endpoint_url=f"http://{hung_server}",
        region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s",
        max_attempts=1, read_timeout_s=1.0, deadline_s=0.2)))
    registry = CollectorRegistry()
    tier.remote.observer = RemoteMetrics(registry)
    with pytest.raises(TierUnavailable, match="did not answer"):
        await tier.put("t/" + "ab" * 16, b"x")
    assert value(registry, "kvtier_object_errors_total", op="list", kind="timeout") == 1
    assert value(registry, "kvtier_object_errors_total", op="list", kind="unavailable") == 0


async def test_a_redis_that_does_not_answer_is_an_error_by_op_and_kind(opened):
    tier = opened.adopt(RedisTier(f"redis://127.0.0.1:{free_port()}/0", 1 << 20,
                            RedisTierConfig(retries=0, connect_timeout_s=0.2)))
    registry = CollectorRegistry()
    tier.observer = RemoteMetrics(registry)
    with pytest.raises(TierUnavailable):
        await tier.get("t/" + "ab" * 16)
    assert value(registry, "kvtier_redis_errors_total", op="get", kind="unavailable") == 1
    assert value(registry, "kvtier_redis_request_seconds_count", op="get") == 1


async def test_a_node_opening_many_shared_sessions_never_overfills_boto3s_pool(
        node_config, caplog):
    async with fleet_nodes(node_config) as open_node:
        a = await open_node("a")
        await asyncio.gather(*(a.spill("acme", f"s{i}", generation=1, ack="durable",
                                       **session(i)) for i in range(48)))
        with caplog.at_level(logging.WARNING, logger="urllib3"):
            b = await open_node("b")  # lists and reads every manifest
            assert len(await b.list_sessions()) == 48
        assert not [r for r in caplog.records if "pool is full" in r.getMessage()]


def test_s3_failures_are_classified_by_kind_and_answers_are_no_errors():
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    from kvstore.tiers.object_media import error_kind

    def answer(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert error_kind(answer("SlowDown", 503)) == "throttled"
    assert error_kind(answer("InternalError", 500)) == "unavailable"
    assert error_kind(answer("AccessDenied", 403)) == "other"
    assert error_kind(answer("NoSuchKey", 404)) is None
    assert error_kind(answer("PreconditionFailed", 412)) is None
    assert error_kind(ReadTimeoutError(endpoint_url="http://s3")) == "timeout"
    assert error_kind(EndpointConnectionError(endpoint_url="http://s3")) == "unavailable"


async def _until(check, bound_s: float = 20.0) -> bool:
    """Polls ``check()`` until it holds (a bound with room for a loaded machine)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while loop.time() - started < bound_s:
        if check():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_every_fleet_node_exports_the_fleets_last_sweep_wherever_it_ran(
        tmp_path, node_config, s3_server, s3_bucket, s3_credentials, capsys):
    """A serving node that runs no sweep exports when the last one ended and whether it
    failed, read from the bucket with its heartbeat: what KVTierFleetGCStale and
    KVTierFleetGCFailing alert on, with nothing scraped but the nodes. ``kvtier
    fleet-gc`` prints its progress on stderr, its ``--json`` intact on stdout."""
    node = node_config("a", fleet_heartbeat_s=0.1, fleet_down_after_s=5.0)
    server, _ = await create_server(load_config(preset="test", env={}, overrides={
        key: getattr(node, key) for key in ("data_dir", "s3_endpoint", "s3_bucket",
                                            "s3_region", "metadata", "node_id",
                                            "fleet_heartbeat_s", "fleet_down_after_s")}
        | {"listen": "127.0.0.1:0", "replay": "off"}))
    sample = server.metrics.registry.get_sample_value
    try:
        assert sample("kvtier_fleet_gc_last_run_timestamp_seconds") == 0  # none yet
        config = tmp_path / "gc.toml"
        config.write_text("\n".join(f'{k} = "{v}"' for k, v in dict(
            data_dir=tmp_path / "gc", metadata="shared", node_id="gc", s3_bucket=s3_bucket,
            s3_endpoint=s3_server, s3_region=s3_credentials["region_name"]).items())
            + "\nfleet_gc_grace_s = 0.0\nfleet_retain_s = 0.0\n")
        sweep = ["fleet-gc", "--config", str(config), "--margin-s", "0.2",
                 "--spill-bound-s", "0.5", "--json"]
        assert await asyncio.to_thread(main, sweep) == 0
        said = capsys.readouterr()
        assert json.loads(said.out)["result"] == "ok"
        steps = [line for line in said.err.splitlines() if line.startswith("kvtier fleet-gc: [")]
        assert any("listing" in s for s in steps) and "done" in steps[-1], said.err
        assert await _until(lambda: sample("kvtier_fleet_gc_last_run_timestamp_seconds") > 0)
        assert sample("kvtier_fleet_gc_last_run_failed") == 0
        ended = sample("kvtier_fleet_gc_last_run_timestamp_seconds")
        # a corrupt manifest stops the next sweep: the nodes say it failed
        meta = server.manager.meta
        await meta.io.put(meta.paths.root + manifest_key("acme", "bad") + ".kvsm", b"garbage")
        assert await asyncio.to_thread(main, sweep) == 0
        assert json.loads(capsys.readouterr().out)["result"] == "error"
        assert await _until(lambda: sample("kvtier_fleet_gc_last_run_failed") == 1)
        # the record's age is on S3's clock, from Last-Modified: whole seconds
        assert sample("kvtier_fleet_gc_last_run_timestamp_seconds") >= ended - 1.0
    finally:
        await server.stop(0.2)
