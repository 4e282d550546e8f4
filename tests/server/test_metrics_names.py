"""Every metric the Grafana dashboard and the Prometheus alert rules name exists on a live
server's /metrics, under Prometheus conventions: the names are read from the PromQL of
deploy/grafana/dashboards/*.json and deploy/alerts.yml, the server is a real one on
loopback after a few RPCs (an error among them)."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvtier import AsyncClient, PermissionDenied, SessionNotFound, Unauthenticated
from tests.support.security import dev_set, secured_server
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bkvtier_[a-z_]+")
SUFFIXES = ("_bucket", "_sum", "_count")  # a histogram's series, named by its base


def _expressions() -> dict[str, str]:
    """Where each PromQL expression comes from -> the expression."""
    out = {}
    for path in sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):  # a row has none
                out[f"{path.name}: {panel['title']} {target['refId']}"] = target["expr"]
    rules = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            out[f"alerts.yml: {rule['alert']}"] = rule["expr"]
    return out


def _families(text: str) -> dict[str, str]:
    """Metric family -> its type, from the exposition's TYPE lines."""
    return {parts[2]: parts[3] for parts in
            (line.split() for line in text.splitlines() if line.startswith("# TYPE "))}


def _samples(text: str) -> dict[str, list[str]]:
    """Sample name -> its series' label sets, as written."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series = line.rsplit(" ", 1)[0]
            name, _, labels = series.partition("{")
            out.setdefault(name, []).append(labels.rstrip("}"))
    return out


def _unobserved_counter(name: str, families: dict[str, str], samples: dict) -> bool:
    """A labelled counter no call has counted yet: its family, no series (the server
    exports it once a call happens, e.g. kvtier_object_errors_total without S3)."""
    base = name.removesuffix("_total")
    return name.endswith("_total") and "counter" in (families.get(base), families.get(name)) \
        and not any(s in samples for s in (name, base + "_created"))


@pytest.fixture(scope="module")
def exposition(tmp_path_factory) -> str:
    tokens = TOKENS = LAYOUT.chunk_tokens + 20

    async def scrape() -> str:
        async with running_server(tmp_path_factory.mktemp("m"), metrics_port=0) as (
                server, target), AsyncClient(target) as kv:
            port = server.start_metrics(0, "127.0.0.1")
            await kv.spill("acme", "s1", LAYOUT.name, tokens_for(tokens),
                           streams_for(LAYOUT, TOKENS), generation=1)
            await kv.restore("acme", "s1")
            await kv.resume("acme", "s1")
            with pytest.raises(SessionNotFound):
                await kv.restore("acme", "no-such-session")
            await kv.stat()  # refreshes the tier manager's snapshot
            return await asyncio.to_thread(lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())

    return asyncio.run(scrape())


def test_the_dashboard_and_alerts_name_only_metrics_the_server_exports(exposition):
    families, samples = _families(exposition), _samples(exposition)
    expressions = _expressions()
    assert len(expressions) >= 20  # the files were read
    missing = {}
    for where, expr in expressions.items():
        for name in NAME.findall(expr):
            base = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
            known = (name in samples or (base != name and families.get(base) == "histogram")
                     or _unobserved_counter(name, families, samples)
                     or families.get(name) == "gauge")  # a labelled one without series yet
            if not known:
                missing.setdefault(name, []).append(where)
    assert not missing, f"named but not exported: {missing}"


def test_names_follow_prometheus_conventions(exposition):
    families, samples = _families(exposition), _samples(exposition)
    kvtier = {name: kind for name, kind in families.items() if name.startswith("kvtier_")}
    assert kvtier
    for name, kind in kvtier.items():
        if kind == "counter" and not _unobserved_counter(f"{name.removesuffix('_total')}"
                                                         "_total", families, samples):
            # its samples end in _total (the TYPE line may say either)
            assert f"{name.removesuffix('_total')}_total" in samples, name
        if kind == "histogram" and name != "kvtier_replay_batch_size":  # a count, no unit
            assert name.endswith("_seconds"), name
    assert "kvtier_tier_read_bytes_total" in samples
    assert "kvtier_tier_written_bytes_total" in samples
    assert not [s for s in samples if "bytes_read" in s or "bytes_written" in s]
    assert samples["kvtier_build_info"] and all(
        'version="' in labels and 'python="' in labels and 'torch="' in labels
        for labels in samples["kvtier_build_info"])
    assert "process_cpu_seconds_total" in samples
    assert "process_resident_memory_bytes" in samples


def test_remote_and_fleet_metrics_are_exported_by_type(exposition):
    """Present on every server, a fleet node or not (their series appear with calls)."""
    families, samples = _families(exposition), _samples(exposition)
    for name in ("kvtier_object_request_seconds", "kvtier_redis_request_seconds",
                 "kvtier_fleet_gate_wait_seconds"):
        assert families[name] == "histogram", name
    for name in ("kvtier_object_errors", "kvtier_redis_errors", "kvtier_fleet_cas",
                 "kvtier_fleet_gc_runs", "kvtier_fleet_gc_deleted"):
        assert "counter" in (families.get(name), families.get(name + "_total")), name
    # the results an alert watches have a series from the start, at 0
    assert sorted(samples["kvtier_fleet_gc_runs_total"]) == ['result="error"', 'result="ok"']
    assert sorted(samples["kvtier_fleet_cas_total"]) == [
        'result="conflict"', 'result="error"', 'result="won"']
    assert families["kvtier_breaker_open"] == "gauge"  # kept (series: remote tiers only)


def test_requests_total_counts_every_rpc_by_method_and_code(exposition):
    requests = _samples(exposition)["kvtier_requests_total"]
    assert all('method="' in labels and 'code="' in labels for labels in requests)
    assert 'code="OK",method="Spill"' in requests
    assert 'code="OK",method="Resume"' in requests
    assert 'code="NOT_FOUND",method="Restore"' in requests
    restores = [line for line in exposition.splitlines()
                if line.startswith("kvtier_requests_total{") and 'method="Restore"' in line]
    assert {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in restores} == {'code="NOT_FOUND",method="Restore"': 1.0,
                                      'code="OK",method="Restore"': 1.0}
    tiers = _samples(exposition)["kvtier_resume_seconds_count"]
    assert tiers == ['tier="host"']  # resume latency by the slowest tier that served it
    assert 'tier="host"' in _samples(exposition)["kvtier_tier_up"]


def test_one_counter_of_calls_by_code_and_no_duplicate_error_counter(exposition):
    # kvtier_rpc_errors_total counted every non-OK call requests_total counts: gone.
    assert not [name for name in _families(exposition) if "rpc_errors" in name]


async def test_calls_the_auth_interceptor_refuses_are_counted_by_method_and_code(tmp_path):
    """UNAUTHENTICATED and a role's PERMISSION_DENIED end the call before the servicer:
    they are counted in kvtier_requests_total all the same, beside the servicer's own."""
    certs = dev_set(tmp_path)
    async with secured_server(tmp_path, certs) as (server, target):
        async with certs.client(target) as anonymous:
            with pytest.raises(Unauthenticated):
                await anonymous.list()
        async with certs.client(target, token="not-a-token") as forged:
            for _ in range(2):
                with pytest.raises(Unauthenticated):
                    await forged.stat()
        async with certs.client(target, "replay") as replay:  # a role KVTier refuses
            with pytest.raises(PermissionDenied):
                await replay.restore("acme", "s1")
        async with certs.client(target, "beta") as beta:  # refused by the servicer
            with pytest.raises(PermissionDenied):
                await beta.restore("acme", "s1")
            await beta.list()
        count = server.metrics.registry.get_sample_value
        assert count("kvtier_requests_total", {"method": "List",
                                               "code": "UNAUTHENTICATED"}) == 1
        assert count("kvtier_requests_total", {"method": "Stat",
                                               "code": "UNAUTHENTICATED"}) == 2
        assert count("kvtier_requests_total", {"method": "Restore",
                                               "code": "PERMISSION_DENIED"}) == 2
        assert count("kvtier_requests_total", {"method": "List", "code": "OK"}) == 1
