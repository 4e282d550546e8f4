"""The connector's counters through vLLM's metrics hooks.

``KVTierStats`` is the ``KVConnectorStats`` both sides report each step (the scheduler its
lookups, the worker its loads, saves and spills); vLLM sums them across workers and steps,
logs them ("KV Transfer metrics: ...") and hands them to ``KVTierPromMetrics``, one
Prometheus counter per field (``vllm:kvtier_<field>``).
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
    "hits": "requests that load a prefix from the store",
    "hit_tokens": "tokens the store held beyond vLLM's own cache",
    "loads": "requests whose KV was loaded",
    "loaded_tokens": "tokens of KV loaded into the paged cache",
    "loaded_bytes": "encoded bytes read from the store",
    "load_seconds": "seconds from a load's start to its last layer",
    "load_error_blocks": "blocks reported to vLLM as load errors (recomputed)",
    "saves": "chunk writes sent to the store",
    "saved_tokens": "tokens of KV in chunks the store wrote",
    "saved_bytes": "encoded bytes of the chunks offered to the store",
    "save_seconds": "seconds saves took (encode and write)",
    "save_errors": "chunk writes that failed",
    "spills": "sessions spilled as their next generation",
    "spill_errors": "session spills that failed",
}


@dataclass
class KVTierStats(KVConnectorStats):
    """``data``: field -> sum over the interval (every field of ``FIELDS``)."""

    def __post_init__(self) -> None:
        for name in FIELDS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        for name in FIELDS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 4) if isinstance(value, float) else value
                for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in FIELDS)


class StatsCounter:
    """Counts from any thread; ``take`` hands the interval's sums over and starts anew."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVTierStats()

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                self._stats.data[name] += value  # KeyError: not a field

    def take(self) -> KVTierStats | None:
        with self._lock:
            stats, self._stats = self._stats, KVTierStats()
        return None if stats.is_empty() else stats


class KVTierPromMetrics(KVConnectorPromMetrics):
    """A counter per field, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:kvtier_{name}", documentation=text,
                                    labelnames=labelnames)
            for name, text in FIELDS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name].labels(*labels).inc(value)
