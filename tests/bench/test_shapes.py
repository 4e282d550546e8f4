"""The generated workload shapes, the goals' honesty checks, and the property that the
project's policy never loses hits to more capacity."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.trace import compare, shapes
from bench.trace.reader import BLOCK_TOKENS, parse_request
from bench.trace.run import layout_sizes, make_tiers, run_benchmark, simulate
from bench.trace.summary import summarize
from bench.trace.workload import build_workload
from kvstore.format.errors import InvalidRequest
from tests.bench.test_trace import parsed, random_trace


@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_shapes_are_seeded_traces_in_the_readers_format(name):
    requests = shapes.generate(name, scale=0.2)
    assert requests == shapes.generate(name, scale=0.2)  # the seed decides everything
    assert requests != shapes.generate(name, scale=0.2, seed=1)
    stamps = [r.timestamp_ms for r in requests]
    assert stamps == sorted(stamps)
    for r in requests:  # what the reader accepts, line by line
        line = json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                           "output_length": r.output_length, "hash_ids": list(r.hash_ids)})
        assert parse_request(line, name) == r
        assert len(r.hash_ids) == -(-r.input_length // BLOCK_TOKENS)
    workload = build_workload(requests, windows=True)
    assert workload.continuations > 0 and workload.lookup_starts > 0
    assert workload.block_reads > workload.unique_blocks  # blocks come back
    assert shapes.parameters(name, 0.2) != shapes.parameters(name)


def test_shapes_have_their_stated_features():
    agent = shapes.generate("agent")
    assert 100_000 < max(r.input_length for r in agent) <= 128 * 1024 + 8000
    gaps = {}
    for r in agent:  # requests of one context share its first task block
        gaps.setdefault(r.hash_ids[8], []).append(r.timestamp_ms)
    assert max(b - a for ts in gaps.values() for a, b in zip(ts, ts[1:], strict=False)) > 600_000
    forks = build_workload(shapes.generate("forks", scale=0.2), windows=True)
    assert sum(len(s.shared) for s in forks.steps) > 0  # siblings share their parent
    mix = shapes.generate("mix")
    lengths = sorted(r.input_length for r in mix)
    assert lengths[len(lengths) // 2] < 6000 < 50_000 < lengths[-1]
    bursts = shapes.generate("bursts", scale=0.2)
    idle = max(b.timestamp_ms - a.timestamp_ms for a, b in zip(bursts, bursts[1:], strict=False))
    assert idle > 3_600_000
    with pytest.raises(InvalidRequest, match="unknown shape"):
        shapes.generate("nope")


def test_goals_refuse_a_share_above_one_and_list_points_above_belady():
    def point(policy, fraction, value, blocks=0.5):
        return {"policy": policy, "capacity_fraction": fraction, "reuse_fast_value": value,
                "reuse_fast_hit_rate": blocks, "reuse_hit_rate": {"hbm": blocks}}

    results = [point("belady", 0.1, 0.8), point("lru", 0.1, 0.5), point("kvtier", 0.1, 0.85),
               point("belady", 0.2, 0.9), point("lru", 0.2, 0.6), point("kvtier", 0.2, 0.8)]
    share = compare.belady_share(results)
    assert share["above_one_at"] == ["0.1"] and not share["met"]
    bound = compare.belady_bound(results, [])
    assert not bound["held"] and [(v["policy"], v["fraction"]) for v in bound["violations"]
                                  ] == [("kvtier", 0.1)]
    mono = compare.monotone(results)
    assert not mono["met"] and mono["by_policy"]["kvtier"]["drops"] == [
        ["0.1", "0.2", 0.85, 0.8]]
    assert compare.never_below_lru(results)["met"]
    one = compare.one_tier_vs_best_classical(
        {"0.1": {"kvtier": 0.4}, "0.2": {"kvtier": 0.7}},
        {"hit_rate_among_rereads": {"0.1": {"ARC": 0.38, "LRU": 0.3, "Belady": 0.9},
                                    "0.2": {"ARC": 0.6, "Cacheus": 0.71}}})
    assert not one["met"] and one["points"]["0.2"]["best"] == "Cacheus"
    assert one["points"]["0.1"]["best"] == "ARC"  # Belady is not a classical policy
    assert compare.one_tier_vs_best_classical({}, {"missing": "x"})["met"] is None


def test_the_run_carries_every_shapes_goals_and_table(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in random_trace(2, requests=40)))
    report = run_benchmark(path, shape_names=["forks"], shape_scale=0.1, fractions=(0.05, 0.2),
                           policies=("kvtier", "lru", "belady"), jobs=1)
    assert set(report["by_shape"]) == {"t", "forks"}
    for row in report["by_shape"].values():
        assert {"monotone", "never_below_lru", "belady_share",
                "one_tier_vs_best_classical", "belady_bound"} <= set(row)
        assert row["belady_bound"]["held"], row["belady_bound"]["violations"]
        assert [t["fraction"] for t in row["table"]] == [0.05, 0.2]
        assert all(t["two_tier_kvtier"] is not None and t["one_tier_lru"] is not None
                   for t in row["table"])
    forks = report["shapes"]["forks"]
    assert forks["shape"]["parameters"]["trees"] == 6 and "validation" not in forks


SIZES = layout_sizes("kvtier-bundled")
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4)


def _value(workload, policy, fraction):
    footprint = workload.unique_blocks * SIZES["block_bytes"]
    sim = simulate(workload, policy, make_tiers(footprint, fraction, 4.0, None),
                   SIZES["block_bytes"], SIZES["window_bytes"])
    return summarize(sim, 128, 160.0)["reuse_fast_value"]


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), pair=st.lists(st.sampled_from(FRACTIONS), min_size=2,
                                                    max_size=2, unique=True).map(sorted),
       policy=st.sampled_from(["kvtier", "lru", "belady"]))
def test_more_capacity_never_loses_hits(seed, pair, policy):
    """On the two-tier stack with windows and retention, the headline figure at the larger
    hbm fraction is at least the smaller one's."""
    workload = build_workload(parsed(random_trace(seed, requests=80)), windows=True)
    small, large = (_value(workload, policy, f) for f in pair)
    assert large >= small - 1e-12, (pair, small, large)
