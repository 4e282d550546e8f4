"""The real ``TierManager`` on a trace prefix, session by session, against the simulation.

It replays the trace the way an engine drives kvtier (``bench.trace.workload``):
sessions past their TTL are ``delete``d; a request continuing its session first
``restore``s it (the chunks and window its previous request stored); a new session asks
``lookup`` for its held prefix and, when there is one, ``spill``s it naming those chunks
by key (no bytes) and ``restore``s it; then each request ``spill``s its own complete
blocks (those already held are deduplicated, not written) as the next generation, with its
resume hint, ``ack="memory"``; ``drain`` then finishes write-back and background
promotions before the next request. Tiers: ``HBMTier`` (CPU device here), ``HostTier``,
``DiskTier`` in a temporary directory; chunks are real encoded chunks of a small layout
over synthetic token ids (block id b at every position of its 512 tokens), keyed by
``kvstore.format.keys.chain_keys`` exactly as a client would. The manager runs with one
request in flight at each stage (``ManagerConfig`` below) so its order of tier moves is
the simulation's, except that a restore promotes chunks in background tasks that may
run after the window's promotion. Belady is left out: its next-use table needs to see
each read as it happens, inside the manager.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from bench.trace.check import CHECK_LAYOUT, WINDOW_TOKENS, encoded_streams, real_hierarchy
from bench.trace.policies import setup_policy
from bench.trace.reader import BLOCK_TOKENS, TraceRequest
from bench.trace.sim import SimTier, TierSim, replay
from bench.trace.workload import DEFAULT_SESSION_TTL_S, Workload, build_workload
from kvstore.format.chunk import encode_chunk
from kvstore.format.keys import ROOT_PARENT, block_key, chunk_digest, chunk_key, dedupe_scope
from kvstore.format.registry import register_layout
from kvstore.session.manager import ManagerConfig, TierManager
from kvstore.tiers.base import MemoryMetaStore

# The bench gives every spill its hint itself (on the trace's clock): no inferred ones.
SEQUENTIAL = ManagerConfig(writeback_workers=1, io_concurrency=1, restore_lookahead=1,
                           infer_hints=False)
TENANT = "trace"


class _Chunks:
    """Encoded chunks and keys of trace blocks (a block id fixes its whole prefix)."""

    def __init__(self) -> None:
        self.spec = register_layout(CHECK_LAYOUT)  # spills look layouts up by id
        self.persistent = encoded_streams(BLOCK_TOKENS, ephemeral=False)
        self.ephemeral = encoded_streams(WINDOW_TOKENS, ephemeral=True)
        self._done: dict[int, tuple[str, str, bytes]] = {}  # block -> chain, block key, bytes

    def tokens(self, blocks: Sequence[int]) -> np.ndarray:
        # (len(blocks) * 512,) uint32: block b's tokens are all b
        return np.repeat(np.asarray(blocks, dtype=np.uint32), BLOCK_TOKENS)

    def chunks(self, blocks: Sequence[int]) -> list[tuple[str, bytes]]:
        parent = ROOT_PARENT
        out = []
        for index, block in enumerate(blocks):
            if block not in self._done:
                tokens = self.tokens([block])
                chain = chunk_key(dedupe_scope(TENANT), self.spec.layout_id, "", parent, tokens)
                data = encode_chunk(self.spec, index * BLOCK_TOKENS, tokens, self.persistent)
                self._done[block] = (chain, block_key(chain, chunk_digest(data)), data)
            chain, key, data = self._done[block]
            out.append((key, data))
            parent = chain
        return out

    def window(self, blocks: Sequence[int]) -> bytes:
        tokens = self.tokens(blocks)
        start = len(tokens) - WINDOW_TOKENS
        return encode_chunk(self.spec, start, tokens[start:], self.ephemeral, ephemeral=True)


async def _replay_manager(workload: Workload, manager: TierManager, chunks: _Chunks,
                          setup, windows: bool) -> dict:
    names = [tier.name for tier in manager.tiers]
    block_hits, window_hits = [0] * len(names), [0] * len(names)
    replays = 0
    generation: dict[int, int] = {}
    layout = chunks.spec.layout_id

    async def restore(session: str, window_expected: bool) -> None:
        nonlocal replays
        result = await manager.restore(TENANT, session)
        for tier in result.chunk_tiers:
            block_hits[names.index(tier)] += 1
        if result.window_tier is not None:
            window_hits[names.index(result.window_tier)] += 1
        elif window_expected:
            replays += 1
        await manager.drain()

    for step, hint in zip(workload.steps, setup.hints, strict=True):
        setup.clock.set(step.time_s)
        for ended in step.ended:  # past its TTL: the framework deletes it
            await manager.delete(TENANT, f"s{ended.session}")
        session = f"s{step.session}"
        if not step.blocks:
            continue
        if step.continues:
            await restore(session, window_expected=step.window_prev is not None)
        elif step.reads:  # a new session from what Lookup finds: named by key, restored
            found = manager.lookup(TENANT, layout, chunks.tokens(step.reads))
            if found.chunks:
                generation[step.session] = 0
                await manager.spill(TENANT, session, layout_id=layout, generation=0,
                                    token_ids=chunks.tokens(step.reads[:len(found.chunks)]),
                                    chunks=[(c.block_key, None) for c in found.chunks])
                await manager.drain()
                await restore(session, window_expected=False)
        generation[step.session] = generation.get(step.session, -1) + 1
        await manager.spill(
            TENANT, session, layout_id=layout, generation=generation[step.session],
            token_ids=chunks.tokens(step.blocks), chunks=chunks.chunks(step.blocks),
            window=chunks.window(step.blocks) if windows else None, hint=hint)
        await manager.drain()
    counters = manager.counters
    return {
        "block_hits": block_hits,
        "window_hits": window_hits,
        "replays": replays,
        "evictions": [counters.evictions[name] for name in names],
        "bytes_written": [counters.bytes_written[name] for name in names],
        "freed_chunks": counters.freed_chunks,
    }


async def _manager_point(workload: Workload, policy: str, capacities: Sequence[int],
                         chunks: _Chunks, hint_sigma: float, seed: int) -> dict:
    setup = setup_policy(workload, policy, hint_sigma=hint_sigma, seed=seed)
    config = dataclasses.replace(SEQUENTIAL, retain_unreferenced=workload.retain)
    with tempfile.TemporaryDirectory(prefix="kvtier-trace-manager-") as root:
        tiers = real_hierarchy(capacities, root)
        manager = await TierManager.open(tiers, MemoryMetaStore(), policy=setup.factory,
                                         config=config)
        async with manager:
            return await _replay_manager(workload, manager, chunks, setup, windows=True)


def check_against_manager(requests: Sequence[TraceRequest], *, policies: Sequence[str],
                          fraction: float = 0.05, host_ratio: float = 4.0,
                          hint_sigma: float = 0.5, seed: int = 0, retain: bool = True,
                          session_ttl_s: float | None = DEFAULT_SESSION_TTL_S) -> dict:
    """Per policy (Belady excepted): the simulation's and the manager's counts."""
    started = time.perf_counter()
    chunks = _Chunks()
    workload = build_workload(requests, windows=True, retain=retain,
                              session_ttl_s=session_ttl_s)
    some = next(step.blocks for step in workload.steps if step.blocks)
    block_bytes, window_bytes = len(chunks.chunks(some)[0][1]), len(chunks.window(some))
    footprint = workload.unique_blocks * block_bytes
    capacities = [int(fraction * footprint), int(host_ratio * fraction * footprint)]
    points = []
    for policy in (p for p in policies if not p.startswith("belady")):
        setup = setup_policy(workload, policy, hint_sigma=hint_sigma, seed=seed)
        sim = TierSim([SimTier("hbm", capacities[0], True, False),
                       SimTier("host", capacities[1], True, False),
                       SimTier("disk", math.inf, False, True)],
                      setup.factory, block_bytes, window_bytes, retain=retain)
        replay(workload, sim, setup.hints, setup.clock.set, setup.advance)
        real = asyncio.run(_manager_point(workload, policy, capacities, chunks, hint_sigma,
                                          seed))
        expected = {k: v for k, v in sim.counters.comparable().items() if k in real}
        reads = sum(expected["block_hits"])
        points.append({
            "policy": policy,
            "capacity_fraction": fraction,
            "agree": expected == real,
            "sim": expected,
            "manager": real,
            "fast_hit_rate": {who: sum(c["block_hits"][:2]) / reads if reads else 0.0
                              for who, c in (("sim", expected), ("manager", real))},
        })
    return {
        "method": "per request: delete the sessions past their TTL; restore its session "
                  "(a continuation), or lookup its blocks and, when some are held, spill a "
                  "new session naming them by key and restore it; spill the request's "
                  "complete blocks as the session's next generation with its hint; drain "
                  "after each call; compared: chunk and window hits per tier, replays, "
                  "evictions and bytes written per tier, chunks freed",
        "requests": len(requests),
        "block_bytes": block_bytes,
        "window_bytes": window_bytes,
        "points": points,
        "agree": all(p["agree"] for p in points),
        "seconds": round(time.perf_counter() - started, 1),
    }
