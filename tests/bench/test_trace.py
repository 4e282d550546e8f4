"""The trace benchmark: reader validation, sessions (continuations, lookups, TTL ends,
retention), the simulation's rules (a hand-computed LRU case), Belady's optimality,
hints, and agreement with the real TierStack and TierManager over real tiers."""

from __future__ import annotations

import itertools
import json
import math
import random
import re

import numpy as np
import pytest

from bench.trace.belady import BeladyPolicy, NextUseTable
from bench.trace.check import check_against_stack
from bench.trace.manager_check import check_against_manager
from bench.trace.reader import read_trace
from bench.trace.run import main, make_tiers, run_trace_benchmark, simulate
from bench.trace.sim import SimTier
from bench.trace.workload import NEVER, build_workload
from kvstore.eviction.reuse import window_cost
from kvstore.format.errors import InvalidRequest
from kvstore.format.registry import get_layout

BLOCK = 512


def write_trace(path, requests):
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def request(t_ms, blocks, tail=True):
    """A request whose complete blocks are ``blocks`` (plus a partial one when ``tail``)."""
    ids = list(blocks) + ([10_000 + t_ms] if tail else [])
    return {"timestamp": t_ms, "input_length": len(blocks) * BLOCK + (100 if tail else 0),
            "output_length": 10, "hash_ids": ids}


def random_trace(seed, requests=80, shared_prefixes=2, p_resume=0.6):
    """Conversations growing by 1-4 blocks a turn, some opening with a shared prompt."""
    rng = random.Random(seed)
    ids = itertools.count()
    prompts = [[next(ids) for _ in range(rng.randint(1, 3))] for _ in range(shared_prefixes)]
    conversations, out, t = [], [], 0
    for _ in range(requests):
        t += rng.randint(0, 3000)
        if conversations and rng.random() < p_resume:
            conv = rng.choice(conversations)
        else:
            conv = list(rng.choice(prompts)) if prompts and rng.random() < 0.5 else []
            conversations.append(conv)
        conv.extend(next(ids) for _ in range(rng.randint(1, 4)))
        out.append({"timestamp": t, "input_length": len(conv) * BLOCK + rng.randint(1, 511),
                    "output_length": rng.randint(1, 100), "hash_ids": conv + [next(ids)]})
    return out


def by_point(report):
    points = {}
    for r in report["results"]:
        points.setdefault(r["capacity_fraction"], {})[r["policy"]] = r
    return points


# -- reader --

GOOD = json.dumps(request(0, [1, 2]))


@pytest.mark.parametrize("bad, words", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"timestamp": 5, "input_length": 10, "output_length": 1}', "missing field"),
    ('{"timestamp": "5", "input_length": 10, "output_length": 1, "hash_ids": []}', "timestamp"),
    ('{"timestamp": 5, "input_length": -1, "output_length": 1, "hash_ids": []}', "input_length"),
    ('{"timestamp": 5, "input_length": 10, "output_length": true, "hash_ids": []}',
     "output_length"),
    ('{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1, -2]}',
     "hash_ids[1]"),
    ('{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [3, 3]}', "twice"),
    ('{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": 7}', "list"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": []}', "earlier"),
])
def test_malformed_line_is_rejected_with_its_line_number(tmp_path, bad, words):
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n\n{json.dumps(request(2, [1, 2, 3]))}\n{bad}\n{GOOD}\n")
    with pytest.raises(InvalidRequest, match=r"t\.jsonl:4: ") as info:
        read_trace(path)
    assert words in str(info.value)


def test_reader_skips_blank_lines_honours_limit_and_refuses_empty(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [request(0, [1]), request(5, [1, 2])])
    path.write_text(path.read_text() + "\n\n")
    assert [r.hash_ids for r in read_trace(path)] == [(1, 10_000), (1, 2, 10_005)]
    assert len(read_trace(path, limit=1)) == 1
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InvalidRequest, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")
    with pytest.raises(InvalidRequest, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")


def test_cli_reports_a_bad_trace_and_exits_2(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n" + GOOD.replace('"hash_ids"', '"hashes"') + "\n")
    assert main(["--trace", str(path), "--json", "--validate", "0", "--jobs", "1",
                 "--lookup-tokens", "0"]) == 2
    assert "t.jsonl:2: missing field(s) ['hash_ids']" in capsys.readouterr().err


# -- sessions --

def parsed(trace):
    from bench.trace.reader import parse_request

    return [parse_request(json.dumps(r), f"line {i}") for i, r in enumerate(trace)]


def test_sessions_follow_the_hash_chain_and_branches_start_from_a_lookup():
    requests = parsed([request(0, [1, 2]), request(1000, [1, 2, 3]), request(2000, [1, 9]),
                       request(2500, [1, 2, 3, 4]), request(4000, [1, 9, 8]),
                       request(5000, [1, 2, 5])])
    workload = build_workload(requests, windows=True)
    steps = workload.steps
    # [1, 9] shares only block 1; [1, 2, 5] branches from r0, whose session moved on
    assert [s.session for s in steps] == [0, 0, 2, 0, 2, 5]
    assert [s.continues for s in steps] == [False, True, False, True, True, False]
    assert [s.window_prev for s in steps] == [None, -1, None, -2, -3, None]
    assert [s.next_gap_s for s in steps] == [1.0, 1.5, 2.0, None, None, None]
    # a continuation reads its session's stored blocks; a new session its looked-up prefix
    assert [s.reads for s in steps] == [(), (1, 2), (1,), (1, 2, 3), (1, 9), (1, 2)]
    assert [s.prev_blocks for s in steps] == [(), (1, 2), (), (1, 2, 3), (1, 9), ()]
    assert [set(s.shared) for s in steps] == [set(), set(), {1}, {1}, {1}, {1, 2}]
    assert steps[1].blocks == (1, 2, 3)  # the partial tail block is left out
    assert (workload.continuations, workload.sessions, workload.lookup_starts,
            workload.tail_blocks) == (3, 3, 2, 6)


def test_sessions_end_after_their_ttl_and_lookups_find_what_retention_kept():
    """r1 continues r0; r2 comes 1.5 s after r1 with a TTL of 1.2 s: session 0 is gone, so
    r2 starts a new session from a lookup. With retention every stored block is still
    held; without it only block 1, which r3's live session still names."""
    trace = [request(0, [1, 2]), request(1000, [1, 2, 3]), request(1900, [1, 7]),
             request(2500, [1, 2, 3, 4])]
    kept = build_workload(parsed(trace), windows=True, session_ttl_s=1.2)
    freed = build_workload(parsed(trace), windows=True, session_ttl_s=1.2, retain=False)
    for workload in (kept, freed):
        assert [s.continues for s in workload.steps] == [False, True, False, False]
        assert [[e.session for e in s.ended] for s in workload.steps] == [[], [], [], [0]]
        assert workload.steps[3].ended[0].blocks == (1, 2, 3)
        assert workload.steps[3].ended[0].window == -2
    assert kept.steps[3].reads == (1, 2, 3)
    assert freed.steps[3].reads == (1,)
    tiers = make_tiers(1000, 1.0, 4.0, None)
    c = simulate(kept, "lru", tiers, block_bytes=100, window_bytes=0).counters
    assert (c.reprefill_blocks, c.freed_chunks, c.retained_hits) == (0, 0, 2)
    c = simulate(freed, "lru", tiers, block_bytes=100, window_bytes=0).counters
    assert (c.reprefill_blocks, c.freed_chunks, c.retained_hits) == (2, 2, 0)


# -- the simulation's rules --

def test_lru_matches_a_hand_computed_case():
    """hbm holds two blocks, host none, disk everything; no windows.

    r0 [1,2]: both new, spilled to hbm (1 older), written back to disk.
    r1 [3]: new; its spill evicts 1 (LRU) down to disk, which holds it.   hbm {2,3}
    r2 [1]: disk hit, promoted: evicts 2.                                  hbm {3,1}
    r3 [2,3]: 2 from disk, promoted: evicts 1, not the older 3, which this
              request reads too (protected); then 3 is an hbm hit.        hbm {3,2}
    r4 [2]: hbm hit.    r5 [1]: disk hit, promoted: evicts 3.              hbm {2,1}
    """
    trace = [[1, 2], [3], [1], [2, 3], [2], [1]]
    workload = build_workload(parsed([request(i, b) for i, b in enumerate(trace)]),
                              windows=False)
    tiers = [SimTier("hbm", 2 * 100, True, False), SimTier("host", 0, True, False),
             SimTier("disk", math.inf, False, True)]
    c = simulate(workload, "lru", tiers, block_bytes=100, window_bytes=0).counters
    assert c.block_hits == [2, 0, 3]
    assert (c.new_blocks, c.reprefill_blocks, c.replays) == (3, 0, 0)
    assert c.evictions == [4, 0, 0]
    assert c.bytes_written["promotion"] == [300, 0, 0]
    assert c.bytes_written["spill"] == [300, 0, 0]
    assert c.bytes_written["writeback"] == [0, 0, 300]
    assert c.bytes_written["demotion"] == [0, 0, 0]  # disk already held every victim


def test_a_branch_never_replaces_its_source_session():
    """r2 branches from r0 after r1 continued it: r2 starts its own session from a lookup
    of [1, 2], so r3, which continues r1, finds block 3 still stored."""
    workload = build_workload(parsed([request(0, [1, 2]), request(1, [1, 2, 3]),
                                      request(2, [1, 2, 4]), request(3, [1, 2, 3, 5])]),
                              windows=False)
    assert [s.session for s in workload.steps] == [0, 0, 2, 0]
    tiers = make_tiers(1000, 1.0, 4.0, None)
    c = simulate(workload, "lru", tiers, block_bytes=100, window_bytes=0).counters
    assert (c.freed_chunks, c.reprefill_blocks, c.lookup_starts) == (0, 0, 1)
    assert c.block_hits == [7, 0, 0] and c.new_blocks == 5


def test_bounded_disk_drops_blocks_and_forces_reprefill(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", random_trace(3, requests=60))
    report = run_trace_benchmark(path, fractions=(0.05,), disk_fraction=0.3,
                                 policies=("lru",), jobs=1)
    point = report["results"][0]
    assert point["chunks_dropped"] > 0 and point["reprefill_blocks"] > 0
    rate = point["block_hit_rate"]
    assert sum(rate.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(4))
def test_belady_hits_at_least_as_often_as_every_policy(tmp_path, seed):
    path = write_trace(tmp_path / "t.jsonl", random_trace(seed))
    policies = ("kvtier", "kvtier-returns", "lru", "hint", "hint-perfect", "hint-causal",
                "belady", "belady-blocks")
    fractions = (0.02, 0.05, 0.1, 0.2)
    # one tier of equal-size blocks (no window blobs, no host): Belady's MIN is optimal
    single = run_trace_benchmark(path, layout="deepseek-v3", fractions=fractions,
                                 host_ratio=0.0, policies=policies, jobs=1)
    for fraction, point in by_point(single).items():
        best = point["belady"]["block_hit_rate"]["hbm"]
        for policy, result in point.items():
            assert result["block_hit_rate"]["hbm"] <= best + 1e-12, (fraction, policy)
    # the full hierarchy with window blobs (15 blocks' bytes, a replay's cost each): the
    # better of the weighted and the plain Belady leads on the headline figure and on the
    # blocks' fast hit rate, and the run's own check agrees
    full = run_trace_benchmark(path, fractions=fractions, policies=policies, jobs=1)
    for fraction, point in by_point(full).items():
        for metric in ("reuse_fast_value", "reuse_fast_hit_rate"):
            best = max(point[p][metric] for p in ("belady", "belady-blocks"))
            for policy, result in point.items():
                assert result[metric] <= best + 1e-12, (fraction, policy, metric)
    assert full["goals"]["belady_bound"]["held"], full["goals"]["belady_bound"]["violations"]


def test_belady_weighs_a_distance_by_size_over_cost():
    """A window (15 chunks' bytes, a replay's cost) read later than a chunk: plain Belady
    evicts the window, the weighted one the chunk, unless the chunk is never read again."""
    reads = np.array([1, -1, 2, 1, -1], dtype=np.int64)  # chunks 1, 2; window -1
    next_read = np.array([3, 4, NEVER, NEVER, NEVER], dtype=np.int64)
    table = NextUseTable(reads, next_read, {1: 0, -1: 1, 2: 2})
    weighted = BeladyPolicy(table, window_cost(lambda key: key < 0))
    plain = BeladyPolicy(table)
    table.advance(0)
    table.advance(1)
    for policy in (weighted, plain):
        policy.on_insert(1, 100)
        policy.on_insert(-1, 1500)
    assert plain.victim() == -1 and weighted.victim() == 1
    table.advance(2)
    weighted.on_insert(2, 100)  # never read again: first out, whatever its weight
    assert weighted.victim() == 2 and weighted.victim({2}) == 1
    assert not weighted.admits(3, 100)  # a block never read is worth no room


def test_perfect_hints_match_belady_on_one_tier(tmp_path):
    """Without shared prefixes every block of a conversation is next read at the
    conversation's next request, which a perfect hint names exactly."""
    path = write_trace(tmp_path / "t.jsonl", random_trace(1, 120, shared_prefixes=0,
                                                          p_resume=0.8))
    report = run_trace_benchmark(path, layout="deepseek-v3", fractions=(0.05, 0.1, 0.2),
                                 host_ratio=0.0, policies=("lru", "hint-perfect", "belady"),
                                 jobs=1)
    gains = []
    for point in by_point(report).values():
        perfect, belady = point["hint-perfect"]["fast_hit_rate"], point["belady"]["fast_hit_rate"]
        assert perfect == pytest.approx(belady, abs=0.01)
        gains.append(perfect - point["lru"]["fast_hit_rate"])
    assert max(gains) > 0.05  # and LRU is clearly short of it


@pytest.mark.parametrize("retain", [True, False])
def test_simulation_agrees_with_the_real_tier_stack(retain):
    requests = parsed(random_trace(5, requests=40))
    # a TTL short enough that sessions end, so retention (or freeing) is exercised
    result = check_against_stack(requests, policies=("kvtier", "lru", "hint", "belady"),
                                 fractions=(0.03, 0.15), retain=retain, session_ttl_s=20)
    assert result["agree"], [p["diff"] for p in result["points"] if not p["agree"]]
    hits = [sum(p["stack"]["block_hits"][1:]) for p in result["points"]]
    assert max(hits) > 0  # blocks really came back from below hbm


@pytest.mark.parametrize("retain", [True, False])
def test_simulation_agrees_with_the_real_tier_manager(retain):
    """Request by request: deletes past the TTL, restore or lookup + spill by key +
    restore, spill of the next generation, drain."""
    requests = parsed(random_trace(6, requests=40, p_resume=0.7))
    result = check_against_manager(requests, policies=("kvtier", "lru", "hint", "belady"),
                                   fraction=0.04, retain=retain, session_ttl_s=20)
    assert [p["policy"] for p in result["points"]] == ["kvtier", "lru", "hint"]
    assert result["agree"], [(p["sim"], p["manager"]) for p in result["points"]]
    for point in result["points"]:
        assert sum(point["manager"]["block_hits"]) > 0  # sessions were really restored
        assert point["manager"]["evictions"][0] > 0  # and hbm had to make room


def test_json_output_and_tiers(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", random_trace(7, requests=30))
    assert main(["--trace", str(path), "--json", "--fractions", "0.05,0.2", "--policies",
                 "lru,belady", "--validate", "20", "--jobs", "1", "--lookup-tokens", "1024"]
                ) == 0
    report = json.loads(capsys.readouterr().out)
    lookup = report["lookup"]  # the bundled model prefilled 1024 tokens; lookup found them
    assert lookup["tokens_held"] == 1024 and lookup["met"]
    assert 0 < lookup["lookup_s"] < lookup["prefill_s"]
    assert report["validation"]["agree"]
    assert [(r["policy"], r["capacity_fraction"]) for r in report["results"]] == [
        ("lru", 0.05), ("belady", 0.05), ("lru", 0.2), ("belady", 0.2)]
    spec = get_layout("kvtier-bundled")
    block = math.ceil(spec.persistent_bytes_per_token * 512)
    assert report["layout"]["block_bytes"] == block
    assert report["layout"]["window_bytes"] == math.ceil(spec.ephemeral_bytes_per_token * 128)
    footprint = report["trace"]["unique_blocks"] * block
    assert report["results"][0]["capacities_bytes"] == {
        "hbm": int(0.05 * footprint), "host": int(0.2 * footprint), "disk": None}
    assert {"block_bytes", "window_bytes", "sessions", "retention", "hints", "belady"} <= set(
        report["method"])
    retention = report["retention"]
    assert (retention["policy"], retention["capacity_fraction"]) == ("lru", 0.2)
    assert retention["with"]["block_reads"] == retention["without"]["block_reads"]
    for r in report["results"]:
        kinds = r["reuse_by_kind"]
        assert (kinds["same_session"]["reads"] + kinds["other_session"]["reads"]
                == r["block_reads"] - r["new_blocks"])
    assert make_tiers(1000, 0.1, 4.0, 0.5)[2].capacity_bytes == 500


def test_a_trace_without_complete_blocks_is_refused(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [request(0, []), request(9, [])])
    with pytest.raises(InvalidRequest, match="no complete 512-token block"):
        run_trace_benchmark(path, jobs=1)
    path = write_trace(tmp_path / "u.jsonl", [request(0, []), request(9, [4])])
    with pytest.raises(InvalidRequest, match="first 1 requests hold no complete block"):
        run_trace_benchmark(path, jobs=1, validate_requests=1)


def test_the_what_if_of_a_policy_ranking_retained_chunks(tmp_path):
    """Retained chunks go first in the product; the what-if lets the policy rank them. A
    short TTL ends sessions, so there are retained chunks to rank."""
    path = write_trace(tmp_path / "t.jsonl", random_trace(4, requests=80))
    runs = [run_trace_benchmark(path, fractions=(0.05,), policies=("kvtier",), jobs=1,
                                session_ttl_s=5, retained_first=first, one_tier_comparison=False)
            for first in (True, False)]
    assert [r["retained_first"] for r in runs] == [True, False]
    assert runs[0]["retention"]["with"]["retained_chunks"] > 0
    assert all(r["results"][0]["reprefill_blocks"] == 0 for r in runs)  # disk keeps them
    with pytest.raises(InvalidRequest, match="validate 0"):
        run_trace_benchmark(path, jobs=1, validate_requests=10, retained_first=False)


@pytest.mark.parametrize("options, words", [
    ({"policies": ("lru", "fifo")}, "unknown policies ['fifo']"),
    ({"fractions": (0.1, 0.0)}, "fractions must be > 0"),
    ({"disk_fraction": 0.0}, "disk_fraction > 0"),
    ({"layout": "no-such-layout"}, "unknown layout"),
])
def test_bad_options_are_refused(tmp_path, options, words):
    path = write_trace(tmp_path / "t.jsonl", random_trace(0, requests=5))
    with pytest.raises(InvalidRequest, match=re.escape(words)):  # UnknownLayout is one too
        run_trace_benchmark(path, jobs=1, **options)
