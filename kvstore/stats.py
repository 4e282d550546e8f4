"""Counters of the store, in the shape the service exports as Prometheus metrics.

Per-tier counters are keyed by tier name; every figure only ever grows (Prometheus
counters). The manager's gauges (write-back depth, tier usage) are in ``ManagerStats``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Counters:
    lookups: int = 0  # chunk and window reads asked of the stack
    misses: int = 0  # reads no tier could answer with intact bytes
    spills: int = 0
    restores: int = 0
    dedupe_hits: int = 0  # spilled chunks some tier already held
    windows_dropped: int = 0  # window blobs evicted below the window tiers
    writeback_done: int = 0
    writeback_failed: int = 0  # chunk write-back attempts that failed
    writeback_failed_sessions: int = 0  # session generations marked writeback_failed
    freed_chunks: int = 0  # chunks deleted everywhere at reference count zero
    hits: Counter[str] = field(default_factory=Counter)  # reads served, per tier
    bytes_read: Counter[str] = field(default_factory=Counter)
    bytes_written: Counter[str] = field(default_factory=Counter)
    evictions: Counter[str] = field(default_factory=Counter)  # blocks a tier gave up
    # blocks written into a tier by eviction or demote (Evict), and by restore
    demotions: Counter[str] = field(default_factory=Counter)
    promotions: Counter[str] = field(default_factory=Counter)
    fallthrough_corrupt: Counter[str] = field(default_factory=Counter)  # bad copy per tier
    fallthrough_unavailable: Counter[str] = field(default_factory=Counter)
    tier_errors: Counter[str] = field(default_factory=Counter)  # failed puts and deletes

    def snapshot(self) -> dict:
        return {
            name: dict(value) if isinstance(value, Counter) else value
            for name, value in vars(self).items()
        }
