"""bench.fleet at its tiny size: real replicas, the resume paths it claims to time (the
window kept on the same replica, replay elsewhere with the chunks from the shared Redis,
a cold node reading the bucket only), router-sent resumes that never replay, resumes
routed by ``AsyncClient(servers=...)`` that never replay against round-robin ones that
replay off the home node, a fresh node's first resume with and without the replay warm-up, and its
REPORT.md section."""

from __future__ import annotations

from bench import all as bench_all
from bench.report import fleet_section


def test_the_fleet_benchmark_times_the_paths_it_names_and_renders():
    result = bench_all.child_json("fleet", bench_all.SIZES["tiny"]["fleet"])
    paths = result["time_to_ready"]
    kept, other, cold = (paths[name] for name in (
        "same_replica_window_kept", "other_replica_replay", "cold_node_s3_only"))
    assert kept["replayed"] == 0 and kept["tiers"] == ["host"]
    assert other["replayed"] == other["resumes"] > 0
    assert other["tiers"] == ["redis"]  # a's spills wrote the chunks through to Redis
    assert cold["replayed"] == cold["resumes"] and cold["tiers"] == ["object"]
    assert paths["re_prefill"]["median_ms"] > 0
    assert [r["replicas"] for r in result["aggregate"]] == [1, 3]
    assert all(r["replayed"] == 0 for r in result["aggregate"])  # routed to the window's node
    manifest = result["manifest_round_trip"]
    assert manifest["round_trip_p50_ms"] >= manifest["put_p50_ms"] > 0
    routes = result["routing"]
    assert routes["routed"]["replayed"] == 0  # each resume on the session's home node
    # round-robin lands off the home node, and there replays
    assert 0 < routes["unrouted"]["replayed"] == routes["other_node"]["resumes"]
    assert routes["other_node"]["replayed"] == routes["other_node"]["resumes"]
    on, off = result["first_resume"]
    assert on["replay_warmup"] and not off["replay_warmup"]
    assert on["replayed"] and off["replayed"]
    text = "\n".join(fleet_section(result))
    assert "## Fleet" in text and "| cold node s3 only |" in text and "3 replicas / 1" in text
    assert "| routed (" in text and "| replay_warmup on |" in text
