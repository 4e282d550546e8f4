"""bench.peers: the side-by-side lines summarized into medians and kvtier / LMCache ratios."""

from bench.peers import summarize


def line(who, **figures):
    return {"who": who, "r": {"n": 4, "value_bytes": 1 << 20, **figures}}


def test_medians_ratios_and_goals():
    lines = [line("lmcache", lmc_store_plus_fsync_GBps=1.0, lmc_store_GBps=2.0,
                  lmc_retrieve_cold_batched_GBps=1.0, lmc_retrieve_cold_seq_GBps=1.0,
                  raw_read_cold_seq_GBps=1.5, lmc_exact=True),
             line("lmcache", lmc_store_plus_fsync_GBps=3.0, lmc_store_GBps=2.0,
                  lmc_retrieve_cold_batched_GBps=1.0, lmc_retrieve_cold_seq_GBps=1.0,
                  raw_read_cold_seq_GBps=1.5, lmc_exact=True),
             line("kvtier", kvt_store_durable_GBps=2.6, kvt_store_concurrent_puts_durable_GBps=1,
                  kvt_get_cold_concurrent_GBps=1.2, kvt_get_cold_seq_GBps=0.9,
                  kvt_get_cold_seq_exact=True)]
    got = summarize(lines)
    rows = {r["path"]: r for r in got["rows"]}
    assert rows["durable store"]["lmcache_gbps"] == 2.0  # the median of 1 and 3
    assert rows["durable store"]["kvtier_vs_lmcache"] == 1.3 and rows["durable store"]["met"]
    assert rows["cold sequential read"]["met"] is False
    assert rows["store, LMCache without fsync"]["met"] is None  # no goal on that path
    assert got["goals_met"] is False and got["all_exact"] is True
    assert got["runs"] == {"kvtier": 1, "lmcache": 2} and got["raw_read_cold_seq_gbps"] == 1.5
    lines[2]["r"]["kvt_get_cold_seq_exact"] = False
    assert summarize(lines)["all_exact"] is False
