"""One simulated run's figures (``bench.trace.sim.TierSim``): the headline (fast hits among
re-reads, each resume's window weighed as a replay), hit rates per tier, windows, replays,
evictions and reuse by kind of block."""

from __future__ import annotations

import math

from bench.trace.reader import BLOCK_TOKENS
from bench.trace.sim import CAUSES, SimCounters, TierSim


def summarize(sim: TierSim, window_tokens: int, replay_cost: float) -> dict:
    c, names = sim.counters, [t.name for t in sim.tiers]
    reads, reuse = c.block_reads, c.block_reads - c.new_blocks
    hits = dict(zip(names, c.block_hits, strict=True))
    fast = hits["hbm"] + hits["host"]
    weight = reuse + replay_cost * c.resumes
    return {
        # the headline: fast hits among re-reads, a resume's window weighed as a replay
        "reuse_fast_value": (fast + replay_cost * sum(c.window_hits)) / weight if weight else 0.0,
        "capacities_bytes": {t.name: None if math.isinf(t.capacity_bytes) else int(t.capacity_bytes)
                             for t in sim.tiers},
        "block_hit_rate": {**{n: h / reads for n, h in hits.items()},
                           "new": c.new_blocks / reads, "reprefill": c.reprefill_blocks / reads},
        "fast_hit_rate": (hits["hbm"] + hits["host"]) / reads,
        "reuse_hit_rate": {n: h / reuse if reuse else 0.0 for n, h in hits.items()},
        "reuse_fast_hit_rate": (hits["hbm"] + hits["host"]) / reuse if reuse else 0.0,
        "reuse_by_kind": _reuse_by_kind(c, names, reuse),
        "block_reads": reads,
        "block_hits": hits,
        "new_blocks": c.new_blocks,
        "reprefill_blocks": c.reprefill_blocks,
        "reprefill_tokens": c.reprefill_blocks * BLOCK_TOKENS,
        "reprefill_requests": c.reprefill_requests,
        "resumes": c.resumes,
        "window_hits": dict(zip(names, c.window_hits, strict=True)),
        "replays": c.replays,
        "lookup_starts": c.lookup_starts,
        "lookup_blocks": c.lookup_blocks,
        "retained_hits": c.retained_hits,
        "retained_chunks": c.retained_chunks,
        "freed_chunks": c.freed_chunks,
        "sessions_ended": c.sessions_ended,
        "replay_tokens": c.replays * window_tokens,
        "bytes_moved": {cause: {n: b for n, b in zip(names, c.bytes_written[cause], strict=True)
                                if b} for cause in CAUSES},
        "evictions": dict(zip(names, c.evictions, strict=True)),
        "windows_dropped": c.windows_dropped,
        "chunks_dropped": c.chunks_dropped,
    }


def _reuse_by_kind(c: SimCounters, names: list[str], reuse: int) -> dict:
    """Fast (hbm + host) hit rate of re-reads within a session and across sessions."""
    fast = [i for i, name in enumerate(names) if name in ("hbm", "host")]
    shared_fast = sum(c.shared_hits[i] for i in fast)
    own_fast = sum(c.block_hits[i] for i in fast) - shared_fast
    own_reads = reuse - c.shared_reads
    return {
        "same_session": {"reads": own_reads,
                              "fast_hit_rate": own_fast / own_reads if own_reads else 0.0},
        "other_session": {"reads": c.shared_reads, "fast_hit_rate":
                               shared_fast / c.shared_reads if c.shared_reads else 0.0},
    }


# per worker process, built once by _init_worker: (retain, windows) -> workload
