"""Prometheus metrics of one server, in a registry of its own (tests run several servers).

Latency histograms and the service's own counters are updated as RPCs run. The tier
manager's figures (lookups, hits, bytes, evictions, tier usage, write-back depth) are
exported from the latest ``ManagerStats`` snapshot, which the server refreshes every
``metrics_interval_s`` on its event loop, so a scrape (on the HTTP server's thread)
never touches the store.

Per-tier lookups follow the cache-hierarchy convention: a read that was served by a tier
above never reached this one, so ``lookups[tier] = lookups - sum(hits of higher tiers)``
and ``hits / lookups`` is the tier's own hit rate.

Names follow the Prometheus conventions: units in the name (``_seconds``, ``_bytes``),
counters end in ``_total``. Every RPC is counted by method and final status code in
``kvtier_requests_total`` (the error ratio is its non-OK share) and timed by method in
``kvtier_request_seconds``; restore and resume latency carry the slowest ``tier`` that
served the session. The registry also holds the process and platform collectors and
``kvtier_build_info``, as the default registry would.

``kvtier_breaker_open{dependency}`` is 1 while the circuit breaker of a remote
dependency (``object``, ``redis``, ``replay:<address>``: ``kvstore.remote.breaker``) is open,
read from the breakers at scrape time (plain attribute reads, safe from the HTTP thread).

The remote calls' latency and errors and the fleet's protocol (``kvtier_object_*``,
``kvtier_redis_*``, ``kvtier_fleet_*``) are ``self.remote`` (``services.server.remote_metrics``).

Per-tenant figures (``kvtier_tenant_*``, ``kvtier_quota_*``) carry a ``tenant`` label only
for tenants named in a ``[quota.<tenant>]`` table; every other tenant is summed under
``tenant="other"``, so their number of series is bounded by the config, not by clients.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from typing import Any

from prometheus_client import (
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.remote.breaker import CircuitBreaker
from kvstore.session.manager import ManagerStats
from services.server.remote_metrics import RemoteMetrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def tier_lookups(stats: ManagerStats) -> dict[str, int]:
    """Reads that reached each tier (see the module docstring)."""
    hits = stats.counters["hits"]
    remaining = stats.counters["lookups"]
    out = {}
    for tier in stats.tiers:
        out[tier.name] = max(remaining, hits.get(tier.name, 0))
        remaining -= hits.get(tier.name, 0)
    return out


class _ManagerCollector(Collector):
    def __init__(self) -> None:
        self.latest: ManagerStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.latest  # one reference read: the snapshot is immutable
        if stats is None:
            return
        c = stats.counters
        per_tier = {
            "tier_lookups": ("Reads that reached the tier", tier_lookups(stats)),
            "tier_hits": ("Reads the tier served with intact bytes", c["hits"]),
            "tier_read_bytes": ("Bytes read from the tier", c["bytes_read"]),
            "tier_written_bytes": ("Bytes written into the tier", c["bytes_written"]),
            "evictions": ("Blocks the tier gave up to make room or on demotion",
                          c["evictions"]),
            "promotions": ("Blocks moved up into the tier", c["promotions"]),
            "demotions": ("Blocks moved down into the tier", c["demotions"]),
            "corrupt_copies": ("Corrupt copies found (and fallen through) in the tier",
                               c["fallthrough_corrupt"]),
        }
        for name, (doc, values) in per_tier.items():
            family = CounterMetricFamily(f"kvtier_{name}", doc, labels=["tier"])
            for tier in stats.tiers:
                family.add_metric([tier.name], values.get(tier.name, 0))
            yield family
        gauges = {
            "tier_used_bytes": ("Bytes held by the tier", lambda t: t.used_bytes),
            "tier_capacity_bytes": ("Configured capacity of the tier", lambda t: t.capacity_bytes),
            "tier_items": ("Blocks held by the tier", lambda t: t.items),
            "tier_up": ("1 when the tier's medium answered, 0 while it is down",
                        lambda t: int(t.available)),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(f"kvtier_{name}", doc, labels=["tier"])
            for tier in stats.tiers:
                gauge.add_metric([tier.name], value(tier))
            yield gauge
        totals = {
            "lookups": ("Chunk and window reads asked of the tier stack", c["lookups"]),
            "misses": ("Reads no tier could answer with intact bytes", c["misses"]),
            "dedupe_hits": ("Spilled chunks a tier already held", c["dedupe_hits"]),
            "windows_dropped": ("Window blobs dropped (replay needed)", c["windows_dropped"]),
            "writeback_done": ("Chunks written back to a durable tier", c["writeback_done"]),
            "writeback_failed": ("Chunk write-back attempts that failed", c["writeback_failed"]),
            "writeback_failures": ("Memory-acked session generations whose write-back "
                                   "failed (marked writeback_failed until durable)",
                                   c["writeback_failed_sessions"]),
            "freed_chunks": ("Chunks deleted at reference count zero", c["freed_chunks"]),
        }
        for name, (doc, value) in totals.items():
            yield CounterMetricFamily(f"kvtier_{name}", doc, value=value)
        yield from _tenant_metrics(stats)
        yield GaugeMetricFamily("kvtier_writeback_queue_depth",
                                "Chunks waiting for write-back", value=stats.writeback_depth)
        yield GaugeMetricFamily("kvtier_writeback_queue_capacity",
                                "Chunks the write-back queue holds before spills wait",
                                value=stats.writeback_capacity)
        yield GaugeMetricFamily("kvtier_referenced_chunks",
                                "Distinct chunks some session references",
                                value=stats.referenced_chunks)
        yield GaugeMetricFamily("kvtier_retained_chunks", "Chunks no session references, "
                                "kept as evictable cache (prefix reuse)",
                                value=stats.retained_chunks)
        yield GaugeMetricFamily("kvtier_retained_bytes", "Bytes of the retained chunks",
                                value=stats.retained_bytes)


class _BreakerCollector(Collector):
    def __init__(self) -> None:
        self.breakers: Callable[[], Iterable[CircuitBreaker]] = tuple

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("kvtier_breaker_open", "1 while the circuit breaker of a "
                                   "remote dependency is open (calls fail fast)",
                                   labels=["dependency"])
        states: dict[str, int] = {}
        for breaker in self.breakers():
            states[breaker.dependency] = max(states.get(breaker.dependency, 0),
                                             int(breaker.is_open))
        for dependency, state in sorted(states.items()):
            family.add_metric([dependency], state)
        yield family


def _tenant_metrics(stats: ManagerStats) -> Iterator[Metric]:
    sessions = GaugeMetricFamily("kvtier_tenant_sessions", "Sessions the tenant stores",
                                 labels=["tenant"])
    stored = GaugeMetricFamily("kvtier_tenant_bytes", "The tenant's bytes as its quotas "
                               "count them (kind: memory, durable; retained: its own domain's "
                               "retained chunks)", labels=["tenant", "kind"])
    limits = GaugeMetricFamily("kvtier_quota_limit", "The tenant's quota limit (absent: "
                               "unlimited)", labels=["tenant", "quota"])
    rejected = CounterMetricFamily("kvtier_quota_rejections", "Spills refused by a quota",
                                   labels=["tenant", "quota"])
    for report in stats.tenants:
        sessions.add_metric([report.tenant], report.usage.sessions)
        stored.add_metric([report.tenant, "memory"], report.usage.memory_bytes)
        stored.add_metric([report.tenant, "durable"], report.usage.durable_bytes)
        stored.add_metric([report.tenant, "retained"], report.usage.retained_bytes)
        for quota, limit in report.limits.table().items():
            limits.add_metric([report.tenant, quota], limit)
        for quota, count in report.rejections.items():
            rejected.add_metric([report.tenant, quota], count)
    yield from (sessions, stored, limits, rejected)


def _build_info(registry: CollectorRegistry) -> None:
    from services.server.version import package_version

    info = Gauge("kvtier_build_info", "Always 1; the labels name what runs",
                 ["version", "python", "torch"], registry=registry)
    try:  # from the installed metadata: importing torch here would cost seconds
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    info.labels(package_version(), platform.python_version(), torch_version).set(1)


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._manager = _ManagerCollector()
        self.registry.register(self._manager)
        self._breakers = _BreakerCollector()
        self.registry.register(self._breakers)
        # Our own registry (tests run several servers) misses the default one's collectors.
        self.registry.register(PROCESS_COLLECTOR)
        self.registry.register(PLATFORM_COLLECTOR)
        r = self.registry
        _build_info(r)
        self.remote = RemoteMetrics(r)
        self.requests = Counter("kvtier_requests", "RPCs by method and final status code",
                                ["method", "code"], registry=r)
        self.request_seconds = Histogram("kvtier_request_seconds", "RPC latency by method",
                                         ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.spill_seconds = Histogram("kvtier_spill_seconds", "Spill RPC latency",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.restore_seconds = Histogram(
            "kvtier_restore_seconds", "Restore and Resume: reading the session's blocks, by "
            "the slowest tier that served them", ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.replay_seconds = Histogram("kvtier_replay_seconds", "Bounded replay latency",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.resume_seconds = Histogram(
            "kvtier_resume_seconds", "Resume RPC: time until the session is ready to decode, "
            "by the slowest tier that served it", ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.replays = Counter("kvtier_replays", "Windows rebuilt by bounded replay",
                               registry=r)
        self.replayed_tokens = Counter("kvtier_replayed_tokens", "Tokens rerun by replay",
                                       registry=r)
        self.replay_batch_size = Histogram(
            "kvtier_replay_batch_size", "Sessions rebuilt by the model call that rebuilt this "
            "one", buckets=(1, 2, 4, 8, 16, 32), registry=r)
        self.spill_bytes = Counter("kvtier_spill_bytes",
                                   "Payload bytes received by Spill and WriteChunks",
                                   ["path"], registry=r)
        self.restore_bytes = Counter("kvtier_restore_bytes",
                                     "Payload bytes sent by restores and ReadChunks",
                                     ["path"], registry=r)
        self.shm_segments = Gauge("kvtier_shm_segments", "Shared-memory segments leased "
                                  "to clients", registry=r)
        # services.server.loop_lag: how late the event loop ran a tick it had due
        self.loop_lag_seconds = Histogram(
            "kvtier_event_loop_lag_seconds", "How late the event loop woke the lag "
            "monitor, per tick", buckets=LATENCY_BUCKETS, registry=r)
        self.loop_stalls = Counter("kvtier_event_loop_stalls", "Lag monitor ticks late by "
                                   "more than the stall bound (50 ms)", registry=r)
        # services.serving.tls_front: a TLS port's connections
        self.plaintext_attempts = Counter("kvtier_plaintext_attempts", "Connections to the "
                                          "TLS port that spoke plaintext (refused)", registry=r)
        self.tls_front_connections = Gauge("kvtier_tls_front_connections", "Connections "
                                           "to the TLS port open now (relayed or being "
                                           "classified)", registry=r)
        self.disk_free = Gauge("kvtier_disk_free_bytes", "Free bytes of the filesystem "
                               "holding data_dir, as of the last metrics refresh", registry=r)
        # services.server.reload: SIGHUP and `kvtier reload`
        self.reload_success = Gauge("kvtier_config_reload_success", "1 when the last "
                                    "reload was taken, 0 when it was refused (the last good "
                                    "version stays in force)", registry=r)
        self.reload_success.set(1)
        self.reloads = Counter("kvtier_config_reloads", "Reloads by result", ["result"],
                               registry=r)
        for result in ("success", "failure"):
            self.reloads.labels(result)
        self._http: Any = None  # the endpoint's server, once started

    def record_error(self, method: str, code: str) -> None:
        """A call that ended with the error status ``code`` (a StatusCode name): refused by
        the auth interceptor before the servicer, or aborted by the servicer."""
        self.requests.labels(method, code).inc()

    def record_done(self, method: str, seconds: float, ok: bool) -> None:
        """A call's handler finished after ``seconds``; ``ok``: without an error (errors
        are counted where the call is aborted, by ``record_error``)."""
        if ok:
            self.requests.labels(method, "OK").inc()
        self.request_seconds.labels(method).observe(seconds)

    def watch_breakers(self, breakers: Callable[[], Iterable[CircuitBreaker]]) -> None:
        """Export the breakers ``breakers()`` lists (asked at every scrape)."""
        self._breakers.breakers = breakers

    def update(self, stats: ManagerStats) -> None:
        self._manager.latest = stats

    @property
    def latest(self) -> ManagerStats | None:
        return self._manager.latest

    def serve_http(self, port: int, addr: str = "127.0.0.1", *, certfile: str | None = None,
                   keyfile: str | None = None) -> int:
        """Start the Prometheus endpoint (``/metrics``) on a thread, over HTTPS with
        ``certfile`` and ``keyfile``; return its port."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry,
                                      certfile=certfile, keyfile=keyfile)
        self._http = server
        return server.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
