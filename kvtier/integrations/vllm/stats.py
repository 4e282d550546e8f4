"""The connector's counters and latencies through vLLM's metrics hooks.

``KVTierStats`` is the ``KVConnectorStats`` both sides report each step (the scheduler its
lookups, the worker its loads, saves and spills); vLLM sums them across workers and steps,
logs them ("KV Transfer metrics: ...") and hands them to ``KVTierPromMetrics``: one
Prometheus counter per field of ``FIELDS`` (``vllm:kvtier_<field>``), and one histogram per
latency of ``LATENCIES`` (``vllm:kvtier_load_seconds``, ``vllm:kvtier_save_seconds``), whose
sum is the seconds as a float (vLLM's ``get_metrics`` reads every counter as a whole
number, so seconds are never counters).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# field -> what it counts (summed over an interval)
FIELDS = {
    "lookups": "prefix lookups asked of the store",
    "lookup_errors": "lookups that failed (taken as misses)",
    "lookup_timeouts": "lookups not answered within lookup_timeout_ms (taken as misses)",
    "lookups_down": "lookups taken as misses at once: kvtier was down",
    "hits": "requests that load a prefix from the store",
    "hit_tokens": "tokens the store held beyond vLLM's own cache",
    "window_loads": "hits whose sliding-window groups' trailing windows the store loaded",
    "window_replays": "hits whose window the engine replays (a group it rebuilds itself)",
    "loads": "requests whose KV was loaded",
    "loaded_tokens": "tokens of KV loaded into the paged cache",
    "loaded_bytes": "encoded bytes read from the store",
    "load_error_blocks": "blocks reported to vLLM as load errors (recomputed)",
    "saves": "chunk writes sent to the store",
    "saved_tokens": "tokens of KV in chunks the store wrote",
    "saved_bytes": "encoded bytes of the chunks offered to the store",
    "save_errors": "chunk writes that failed",
    "saves_skipped": "saves and spills skipped: the save queue was full or kvtier down",
    "spills": "sessions spilled as their next generation",
    "spill_errors": "session spills that failed",
}
# latency -> what it times (each load or save one observation, in seconds)
LATENCIES = {
    "load_seconds": "seconds from a load's start to its last layer",
    "save_seconds": "seconds a save took in the background (encode and write)",
}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0)


@dataclass
class KVTierStats(KVConnectorStats):
    """``data``: field -> sum over the interval (every field of ``FIELDS``), latency -> the
    interval's observations (every latency of ``LATENCIES``)."""

    def __post_init__(self) -> None:
        for name in FIELDS:
            self.data.setdefault(name, 0)
        for name in LATENCIES:
            self.data.setdefault(name, [])

    def reset(self) -> None:
        self.data = {**dict.fromkeys(FIELDS, 0), **{name: [] for name in LATENCIES}}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        for name in FIELDS:
            self.data[name] += other.data.get(name, 0)
        for name in LATENCIES:
            self.data[name] = [*self.data[name], *other.data.get(name, ())]
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in FIELDS}
        for name in LATENCIES:
            out[name] = round(float(sum(self.data[name])), 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in (*FIELDS, *LATENCIES))


class StatsCounter:
    """Counts from any thread; ``take`` hands the interval's sums over and starts anew."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVTierStats()

    def add(self, **counts: float) -> None:
        """Add to counters; a latency's value is one observation of it."""
        with self._lock:
            for name, value in counts.items():
                if name in LATENCIES:
                    self._stats.data[name].append(float(value))
                else:
                    self._stats.data[name] += value  # KeyError: not a field

    def take(self) -> KVTierStats | None:
        with self._lock:
            stats, self._stats = self._stats, KVTierStats()
        return None if stats.is_empty() else stats


class KVTierPromMetrics(KVConnectorPromMetrics):
    """A counter per field and a histogram per latency, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:kvtier_{name}", documentation=text,
                                    labelnames=labelnames)
            for name, text in FIELDS.items()}
        self._histograms = {
            name: self._histogram_cls(name=f"vllm:kvtier_{name}", documentation=text,
                                      labelnames=labelnames, buckets=list(LATENCY_BUCKETS))
            for name, text in LATENCIES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name].labels(*labels).inc(value)
            elif name in self._histograms:
                histogram = self._histograms[name].labels(*labels)
                for seconds in value:
                    histogram.observe(seconds)
