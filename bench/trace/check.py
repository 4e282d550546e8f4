"""Validating the simulation against the product on a trace prefix.

The first N requests are replayed twice with the same policies, hints and virtual
clock: once through ``bench.trace.sim.TierSim``, once through the real
``kvstore.placement.stack.TierStack`` (the tier manager's placement engine) over real tiers:
``HBMTier`` (on the CPU device here), ``HostTier`` and a ``DiskTier`` in a temporary
directory, holding real encoded chunks (``kvstore.format.chunk``; every copy is verified on
each read and demotion). The driver below makes the calls the manager makes for a
restore (``read``, then ``promote`` protecting the session's blocks) and a spill
(``touch``, ``place``, window replacement, write-back through ``read(access=False)``
and ``place`` on the durable tier), a lookup's naming of held chunks, and session ends,
with the manager's ``kvstore.prefix.chains.Retention`` deciding what an unreferenced chunk
becomes. Equal counts mean the simulation's figures are the product's on that prefix.

``bench.trace.manager_check`` checks the ``TierManager`` itself, through its public calls
(lookup, spill by key, restore, delete), on the same workload.

Sizes: a small layout (below) keeps the check light; the simulation is given the very
byte sizes of its encoded block and window.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
from collections.abc import Sequence

import numpy as np
import torch

from bench.trace.policies import setup_policy
from bench.trace.reader import BLOCK_TOKENS, TraceRequest
from bench.trace.sim import SimTier, TierSim, replay
from bench.trace.workload import DEFAULT_SESSION_TTL_S, Workload, build_workload
from kvstore.format.chunk import StreamData, encode_chunk, verify_chunk
from kvstore.format.errors import DataLoss
from kvstore.format.layout import LayoutSpec, Stream
from kvstore.placement.locks import KeyedLocks
from kvstore.placement.stack import WINDOW_PREFIX, TierStack
from kvstore.prefix.chains import Retention
from kvstore.session.restore import READ_BATCH
from kvstore.stats import Counters
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.host import HostTier

CHECK_LAYOUT = LayoutSpec(
    name="trace-check",
    streams=(
        Stream("latent", (32,), bits=4, group_size=32, tokens_per_entry=4),
        Stream("window", (4, 32), bits=8, group_size=32, persistent=False),
    ),
    chunk_tokens=BLOCK_TOKENS,
    window_tokens=128,
)
WINDOW_TOKENS = CHECK_LAYOUT.window_tokens
UNBOUNDED_BYTES = 1 << 50


def encoded_streams(tokens: int, ephemeral: bool) -> dict[str, StreamData]:
    """Random contents for ``tokens`` tokens of CHECK_LAYOUT's persistent (or window) streams:
    codes (layers, entries, *codes_shape), scales (layers, entries, groups) per stream."""
    g = torch.Generator().manual_seed(0)
    streams = {}
    for s in CHECK_LAYOUT.ephemeral_streams if ephemeral else CHECK_LAYOUT.persistent_streams:
        n = s.entries_for(tokens)
        codes = torch.randint(0, 256, (s.layers, n, *s.codes_shape), generator=g,
                              dtype=torch.uint8)
        if s.bits == 8:
            codes = codes.view(torch.int8)
        scales = torch.rand(s.layers, n, s.scales_per_entry, generator=g).half()
        streams[s.name] = StreamData(codes, scales)
    return streams


def _encoded(ephemeral: bool) -> bytes:
    """One encoded chunk (or window blob) of CHECK_LAYOUT."""
    tokens = WINDOW_TOKENS if ephemeral else BLOCK_TOKENS
    return encode_chunk(CHECK_LAYOUT, 0, np.arange(tokens), encoded_streams(tokens, ephemeral),
                        ephemeral=ephemeral)


def _name(key: int) -> str:
    return f"{WINDOW_PREFIX}trace/{-key}" if key < 0 else f"block/{key}"


async def _replay_stack(workload: Workload, stack: TierStack, refs: dict[str, int],
                        retention: Retention, setup, block: bytes, window: bytes) -> dict:
    """The manager's calls for each request, in the order ``trace_sim.replay`` makes them;
    ``refs``: chunk -> sessions naming it (the manager's reference counts)."""
    locks = stack.locks
    durable = [i for i, tier in enumerate(stack.tiers) if tier.durable]
    n = len(stack.tiers)
    block_hits, window_hits = [0] * n, [0] * n
    misses = replays = 0
    position = 0

    async def read(key: str, protect: frozenset[str]) -> int | None:
        try:
            data, source, bad = await stack.read(key)
        except DataLoss:
            return None
        if source > 0 or bad:
            async with locks.hold(key):
                await stack.promote(key, data, source, bad, protect)
        return source

    async def release(keys) -> None:
        gone = []
        for key in keys:
            refs[key] -= 1
            if not refs[key]:
                del refs[key]
                gone.append(key)
        for key in retention.keep(gone):  # retained ones stay; with retention off, all go
            async with locks.hold(key):
                await stack.delete_everywhere(key)

    for step, hint in zip(workload.steps, setup.hints, strict=True):
        setup.clock.set(step.time_s)
        for ended in step.ended:
            await release(_name(b) for b in ended.blocks)
            if ended.window is not None:
                async with locks.hold(_name(ended.window)):
                    await stack.delete_everywhere(_name(ended.window))
        keys = [_name(b) for b in step.blocks]
        session = {_name(b) for b in step.reads}
        if step.window_prev is not None:
            session.add(_name(step.window_prev))
        session = frozenset(session)
        named: list[str] = []
        if not step.continues:  # the lookup's held run, named by key (no hint), then read
            for key in (_name(b) for b in step.reads):
                if not stack.holders(key):
                    break
                async with locks.hold(key):
                    stack.touch(key, None)
                named.append(key)
            for key in named:
                refs[key] = refs.get(key, 0) + 1
        for _ in step.reads:
            if setup.advance is not None:
                setup.advance(position)
            position += 1
        # the restore's reader: each batch's chunks from the highest tier holding them,
        # tier by tier (TierStack.read_many), promotions once it is done
        readable = list(step.reads if step.continues else step.reads[:len(named)])
        promotions = []
        hits_before = sum(block_hits)
        for at in range(0, len(readable), READ_BATCH):
            batch = [_name(b) for b in readable[at:at + READ_BATCH]]
            got = await stack.read_many(batch, [verify_chunk] * len(batch))
            for key, value in zip(batch, got, strict=True):
                if not isinstance(value, DataLoss):
                    block_hits[value[1]] += 1
                    if value[1] > 0 or value[2]:
                        promotions.append((key, *value))
        misses += len(step.reads) - (sum(block_hits) - hits_before)
        if step.window_prev is not None:
            if setup.advance is not None:
                setup.advance(position)
            position += 1
            tier = await read(_name(step.window_prev), session)
            if tier is None:
                replays += 1
            else:
                window_hits[tier] += 1
        for key, data, source, bad in promotions:
            async with locks.hold(key):
                await stack.promote(key, data, source, bad, session)
        if not step.blocks:
            continue
        protect = frozenset(keys)
        for key in keys:  # the manager pins a spill's chunks before storing them
            refs[key] = refs.get(key, 0) + 1
        queued = []
        for key in keys:
            async with locks.hold(key):
                stack.touch(key, hint)
                holders = stack.holders(key)
                if not holders:
                    placed = await stack.place(key, block, protect=protect)
                    holders = [] if placed is None else [placed]
                if not any(i in durable for i in holders):
                    queued.append(key)
        if step.window_new is not None:
            new = _name(step.window_new)
            async with locks.hold(new):
                stack.touch(new, hint)
                await stack.place(new, window)
        await release([_name(b) for b in step.prev_blocks] or named)
        if step.window_prev is not None:
            old = _name(step.window_prev)
            async with locks.hold(old):
                await stack.delete_everywhere(old)
        for key in queued:
            async with locks.hold(key):
                holders = stack.holders(key)
                if not holders or any(i in durable for i in holders):
                    continue
                data, _, _ = await stack.read(key, access=False)
                for j in durable:
                    if await stack.place(key, data, start=j, stop=j + 1) is not None:
                        break
    counters: Counters = stack.counters
    names = [t.name for t in stack.tiers]
    return {
        "block_hits": block_hits,
        "misses": misses,
        "window_hits": window_hits,
        "replays": replays,
        "evictions": [counters.evictions[name] for name in names],
        "bytes_written": [counters.bytes_written[name] for name in names],
        "windows_dropped": counters.windows_dropped,
    }


def real_hierarchy(capacities: Sequence[int], root: str) -> list:
    """The real tiers the simulator mirrors: hbm and host of the given sizes, a disk below."""
    return [HBMTier(capacities[0], device="cpu"), HostTier(capacities[1], pin_memory=False),
            DiskTier(root, UNBOUNDED_BYTES, durable=False)]


async def _stack_point(workload: Workload, policy: str, capacities: Sequence[int],
                       block: bytes, window: bytes, hint_sigma: float, seed: int) -> dict:
    setup = setup_policy(workload, policy, hint_sigma=hint_sigma, seed=seed, name=_name)
    with tempfile.TemporaryDirectory(prefix="kvtier-trace-check-") as root:
        tiers = real_hierarchy(capacities, root)
        refs: dict[str, int] = {}
        stack = TierStack(tiers, setup.factory, KeyedLocks(), Counters(),
                          is_referenced=lambda key: refs.get(key, 0) > 0)
        # the manager's retention (kvstore.prefix.chains), wired as TierManager wires it
        retention = Retention(enabled=workload.retain, ttl_s=None,
                              is_held=lambda key: bool(stack.holders(key)),
                              is_referenced=lambda key: refs.get(key, 0) > 0)
        if workload.retain:
            stack.evict_first = lambda j, skip: retention.victim(stack.policies[j], skip)
        try:
            return await _replay_stack(workload, stack, refs, retention, setup, block, window)
        finally:
            for tier in tiers:
                await tier.close()


def check_against_stack(requests: Sequence[TraceRequest], *, policies: Sequence[str],
                        fractions: Sequence[float] = (0.02, 0.1), host_ratio: float = 4.0,
                        hint_sigma: float = 0.5, seed: int = 0, retain: bool = True,
                        session_ttl_s: float | None = DEFAULT_SESSION_TTL_S) -> dict:
    """Counts of the simulation and of the real TierStack on ``requests``, per point."""
    started = time.perf_counter()
    block, window = _encoded(False), _encoded(True)
    workload = build_workload(requests, windows=True, retain=retain,
                              session_ttl_s=session_ttl_s)
    footprint = workload.unique_blocks * len(block)
    points = []
    covered = {"sessions_ended": 0, "retained_reads": 0, "disk_reads": 0, "misses": 0}
    for fraction in fractions:
        capacities = [int(fraction * footprint), int(host_ratio * fraction * footprint)]
        for policy in policies:
            sim_tiers = [SimTier("hbm", capacities[0], True, False),
                         SimTier("host", capacities[1], True, False),
                         SimTier("disk", math.inf, False, True)]
            setup = setup_policy(workload, policy, hint_sigma=hint_sigma, seed=seed)
            sim = TierSim(sim_tiers, setup.factory, len(block), len(window), retain=retain)
            replay(workload, sim, setup.hints, setup.clock.set, setup.advance)
            c = sim.counters
            for what, n in (("sessions_ended", c.sessions_ended),
                            ("retained_reads", c.retained_hits), ("disk_reads", c.block_hits[2]),
                            ("misses", c.replays + c.read_misses)):
                covered[what] = max(covered[what], n)
            real = asyncio.run(_stack_point(workload, policy, capacities, block, window,
                                            hint_sigma, seed))
            expected = {k: v for k, v in sim.counters.comparable().items() if k in real}
            diff = {k: {"sim": expected[k], "stack": real[k]}
                    for k in expected if expected[k] != real[k]}
            points.append({"policy": policy, "capacity_fraction": fraction,
                           "agree": not diff, "diff": diff, "stack": real})
    return {
        "method": "the same requests, policies, hints and clock through TierSim and through "
                  "kvstore.placement.stack.TierStack over real HBMTier (CPU device), HostTier and "
                  "DiskTier with encoded chunks of a small layout; compared: block and "
                  "window hits per tier, misses, replays, evictions and bytes written per "
                  "tier, windows dropped",
        "requests": len(requests),
        "block_bytes": len(block),
        "window_bytes": len(window),
        "points": points,
        "agree": all(p["agree"] for p in points),
        "span_s": workload.span_s,
        "covered": covered,  # the most any point saw of each
        "seconds": round(time.perf_counter() - started, 1),
    }
