"""What crosses processes each step: plans to the worker, the worker's report back, and the
counters vLLM sums over workers and steps."""

import functools
import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm.connector import KVTierConnector  # noqa: E402
from kvtier.integrations.vllm.metadata import (  # noqa: E402
    KVTierConnectorMetadata,
    KVTierWorkerMetadata,
    LoadPlan,
    SavePlan,
    SpillPlan,
)
from kvtier.integrations.vllm.stats import (  # noqa: E402
    FIELDS,
    LATENCIES,
    KVTierPromMetrics,
    KVTierStats,
    StatsCounter,
)


def test_plans_survive_the_trip_to_the_worker():
    meta = KVTierConnectorMetadata(
        loads=[LoadPlan("a", tuple(range(256)), 1, (7,))],
        saves=[SavePlan("b", tuple(range(384)), 1, (3, 4))],
        spills=[SpillPlan("c", "chat", 2, tuple(range(300)), (1, 2, 3))], delayed=["c"])
    back = pickle.loads(pickle.dumps(meta))
    assert back == meta
    assert back.loads[0].end_chunk == 2 and back.saves[0].end_chunk == 3


def test_worker_reports_aggregate_to_the_earliest_unsaved_chunk():
    a = KVTierWorkerMetadata({"r1": 3, "r2": 5})
    b = KVTierWorkerMetadata({"r1": 1, "r3": 2})
    assert a.aggregate(b).unsaved == {"r1": 1, "r2": 5, "r3": 2}
    assert a.unsaved == {"r1": 3, "r2": 5}  # the parts are left as they were


def test_stats_sum_and_rebuild_from_their_data():
    counter = StatsCounter()
    assert counter.take() is None
    counter.add(loads=1, loaded_tokens=256, load_seconds=0.5)
    counter.add(loads=1, loaded_tokens=128, load_error_blocks=2)
    first = counter.take()
    assert counter.take() is None
    assert (first.data["loads"], first.data["loaded_tokens"]) == (2, 384)
    other = KVTierConnector.build_kv_connector_stats({"saves": 3, "saved_bytes": 100})
    total = first.aggregate(other)
    assert total.reduce()["saves"] == 3 and total.reduce()["load_error_blocks"] == 2
    assert set(total.reduce()) == set(FIELDS) | set(LATENCIES) and not total.is_empty()
    empty = KVTierStats()
    assert empty.is_empty()
    with pytest.raises(KeyError):
        counter.add(nonsense=1)


def test_latencies_are_fractional_seconds_in_histograms():
    """Load and save seconds are observations, summed as floats: vLLM's ``get_metrics``
    reads every counter as a whole number, so 0.25 s counted would read 0."""
    import prometheus_client

    counter = StatsCounter()
    counter.add(loads=1, load_seconds=0.25)
    counter.add(saves=2, save_seconds=0.125)
    counter.add(save_seconds=0.5)
    stats = counter.take()
    assert stats.data["load_seconds"] == [0.25] and stats.data["save_seconds"] == [0.125, 0.5]
    assert stats.reduce()["save_seconds"] == 0.625
    back = KVTierConnector.build_kv_connector_stats(pickle.loads(pickle.dumps(stats.data)))
    assert back.aggregate(stats).data["load_seconds"] == [0.25, 0.25]
    registry = prometheus_client.CollectorRegistry()
    types = {kind: functools.partial(getattr(prometheus_client, kind.__name__),
                                     registry=registry)
             for kind in (prometheus_client.Gauge, prometheus_client.Counter,
                          prometheus_client.Histogram)}
    prom = KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"],
                             {0: ["0"]})
    prom.observe(back.data)
    assert registry.get_sample_value("vllm:kvtier_load_seconds_sum", {"engine": "0"}) == 0.5
    assert registry.get_sample_value("vllm:kvtier_save_seconds_count", {"engine": "0"}) == 4
    assert registry.get_sample_value("vllm:kvtier_saves_total", {"engine": "0"}) == 4
