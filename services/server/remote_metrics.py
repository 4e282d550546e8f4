"""Prometheus metrics of the store's remote calls and of the fleet's protocol, fed by
kvstore's observer hooks (``kvstore.remote.observe``), which ``observe_store`` attaches
to every holder in a tier manager.

* ``kvtier_object_request_seconds{op}``, ``kvtier_object_errors_total{op,kind}``: S3
  calls of the object tier and of the fleet's bucket (one pool of calls for both);
* ``kvtier_redis_request_seconds{op}``, ``kvtier_redis_errors_total{op,kind}``;
* ``kvtier_fleet_cas_total{result}``: conditional writes of shared manifests;
* ``kvtier_fleet_gate_wait_seconds``: a spill's time at the garbage-collection epoch gate;
* ``kvtier_fleet_gc_runs_total{result}``, ``kvtier_fleet_gc_deleted_total``: sweeps this
  process ran (``kvtier fleet-gc`` runs them in its own process, which reports its own
  figures: the server runs none, so these stay 0 on a server);
* ``kvtier_fleet_gc_last_run_timestamp_seconds`` (0: no sweep has run on the bucket) and
  ``kvtier_fleet_gc_last_run_failed``: the fleet's last sweep, from the bucket's
  ``gc/last_run`` (whoever ran it), and ``kvtier_fleet_nodes_down``: nodes whose
  heartbeat is over ``fleet_down_after_s`` old; each fleet node refreshes them with its
  heartbeat (``services.server.fleet_node``), so they hold on an idle node too.

The labelled counters start at 0 for every ``result`` (an alert on the error series has
a series to watch from the start).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.remote.observe import CAS_RESULTS, GC_RESULTS, Observer

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class RemoteMetrics(Observer):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.seconds = {
            dependency: Histogram(f"kvtier_{dependency}_request_seconds",
                                  f"Calls to the {what}, by operation (errors included)",
                                  ["op"], buckets=BUCKETS, registry=r)
            for dependency, what in (("object", "object store (S3)"), ("redis", "Redis tier"))}
        self.errors = {
            dependency: Counter(f"kvtier_{dependency}_errors", f"Failed calls to the {what} "
                                "by operation and kind (timeout, throttled, unavailable, "
                                "other)", ["op", "kind"], registry=r)
            for dependency, what in (("object", "object store (S3)"), ("redis", "Redis tier"))}
        self.cas_total = Counter("kvtier_fleet_cas", "Compare-and-swap writes of shared "
                                 "manifests by result (won, conflict: another node wrote "
                                 "first, error)", ["result"], registry=r)
        self.gate_seconds = Histogram("kvtier_fleet_gate_wait_seconds", "Time a spill waited "
                                      "at the fleet's garbage-collection epoch gate",
                                      buckets=BUCKETS, registry=r)
        self.gc_runs = Counter("kvtier_fleet_gc_runs", "Fleet garbage-collection sweeps "
                               "this process ran, by result", ["result"], registry=r)
        self.gc_deleted = Counter("kvtier_fleet_gc_deleted", "Chunks deleted from the "
                                  "shared bucket by the sweeps this process ran", registry=r)
        self.gc_last_run = Gauge("kvtier_fleet_gc_last_run_timestamp_seconds", "When the "
                                 "fleet's last garbage-collection sweep ended (Unix time; 0: "
                                 "none has run on the bucket)", registry=r)
        self.gc_last_failed = Gauge("kvtier_fleet_gc_last_run_failed", "1 when the fleet's "
                                    "last sweep failed", registry=r)
        self.nodes_down = Gauge("kvtier_fleet_nodes_down", "Fleet nodes whose last heartbeat "
                                "is older than fleet_down_after_s (a clean stop excepted)",
                                registry=r)
        for result in CAS_RESULTS:
            self.cas_total.labels(result)
        for result in GC_RESULTS:
            self.gc_runs.labels(result)

    def request(self, dependency: str, op: str, seconds: float) -> None:
        if dependency in self.seconds:
            self.seconds[dependency].labels(op).observe(seconds)

    def error(self, dependency: str, op: str, kind: str) -> None:
        if dependency in self.errors:
            self.errors[dependency].labels(op, kind).inc()

    def cas(self, result: str) -> None:
        self.cas_total.labels(result).inc()

    def gate_wait(self, seconds: float) -> None:
        self.gate_seconds.observe(seconds)

    def gc_run(self, result: str, deleted: int) -> None:
        self.gc_runs.labels(result).inc()
        self.gc_deleted.inc(deleted)


def observe_store(tiers, meta: object, observer: Observer) -> None:
    """Attach ``observer`` to the remote calls of ``tiers`` and to ``meta`` (a fleet's
    ``SharedMetaStore``: its CAS and gate) where they have hooks."""
    for tier in tiers:
        while hasattr(tier, "inner"):  # kvstore.encryption.tiers.EncryptedTier
            tier = tier.inner
        remote = getattr(tier, "remote", None)
        if remote is not None:  # S3 (kvstore.remote.calls)
            remote.observer = observer
        elif hasattr(tier, "observer"):  # Redis
            tier.observer = observer
    if hasattr(meta, "observer"):
        meta.observer = observer
