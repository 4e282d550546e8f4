"""The tier manager's parts on their own: manifests, reference ledger, locks, collection."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from kvstore.format.errors import ChunkCorrupt, InvalidRequest, SessionNotFound
from kvstore.format.hints import ResumeHint
from kvstore.placement.locks import KeyedLocks, RWLocks
from kvstore.placement.refcount import RefLedger
from kvstore.session.manifest import SessionManifest
from kvstore.tiers.base import REF_PREFIX, MemoryMetaStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from tests.support.manager import make_session, random_tokens, tier_keys

MB = 1 << 20


def test_manifest_round_trip_and_every_corruption_is_refused():
    manifest = SessionManifest(
        tenant="t", session_id="s", layout_id="x@1", generation=7,
        token_ids=np.arange(37, dtype=np.uint32), chunk_keys=("a", "b"), chunk_sizes=(10, 11),
        tail=b"tail-bytes", window_tier="host", window_key="win/t/s/7", ttl_s=60.0,
        hint=ResumeHint(expected_pause_s=12.5, priority=2),
    )
    raw = manifest.encode()
    back = SessionManifest.decode(raw)
    assert back.encode() == raw and back.hint == manifest.hint and back.tail == b"tail-bytes"
    np.testing.assert_array_equal(back.token_ids, np.arange(37))
    assert back.expired(back.last_access + 61) and not back.expired(back.last_access + 59)
    rng = random.Random(3)
    for _ in range(200):
        bad = bytearray(raw)
        bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        with pytest.raises(ChunkCorrupt):
            SessionManifest.decode(bytes(bad))
    for cut in (0, 5, len(raw) // 2, len(raw) - 1):
        with pytest.raises(ChunkCorrupt):
            SessionManifest.decode(raw[:cut])
    with pytest.raises(InvalidRequest):
        manifest.evolve(session_id="a/b")
    with pytest.raises(InvalidRequest):
        manifest.evolve(generation=-1)


async def test_ledger_groups_concurrent_commits_and_keeps_counts_exact():
    meta = MemoryMetaStore()
    ledger = RefLedger(meta)
    keys = [f"k{i}" for i in range(10)]
    rng = random.Random(5)
    expected: dict[str, int] = {}
    jobs = []
    for _ in range(200):
        take = rng.sample(keys, 3)
        jobs.append(ledger.commit({}, acquire=take))
        for key in take:
            expected[key] = expected.get(key, 0) + 1
    await asyncio.gather(*jobs)
    stored = {k[len(REF_PREFIX):]: int(v) for k, v in await meta.scan(REF_PREFIX)}
    assert stored == expected
    # release everything concurrently: each key is reported free exactly once at zero
    freed = await asyncio.gather(*(ledger.commit({}, release=[key])
                                   for key, n in expected.items() for _ in range(n)))
    assert sorted(k for batch in freed for k in batch) == sorted(expected)
    assert await meta.scan(REF_PREFIX) == []
    # a pin keeps a released key from being reported free
    await ledger.commit({}, acquire=["p"])
    ledger.pin(["p"])
    assert await ledger.commit({}, release=["p"]) == []
    assert ledger.unpin(["p"]) == ["p"]


async def test_keyed_and_rw_locks():
    locks = KeyedLocks()
    order = []

    async def hold(key, tag):
        async with locks.hold(key):
            order.append(f"{tag}+")
            await asyncio.sleep(0.01)
            order.append(f"{tag}-")

    await asyncio.gather(hold("a", 1), hold("a", 2), hold("b", 3))
    assert order.index("1-") < order.index("2+")  # same key: one at a time
    assert order.index("3+") < order.index("1-")  # other key: not blocked
    assert not locks.busy("a") and not locks._locks

    rw = RWLocks()
    events = []

    async def reader(tag):
        async with rw.read("s"):
            events.append(f"r{tag}+")
            await asyncio.sleep(0.02)
            events.append(f"r{tag}-")

    async def writer():
        await asyncio.sleep(0.005)
        async with rw.write("s"):
            events.append("w+")
            events.append("w-")

    await asyncio.gather(reader(1), reader(2), writer())
    assert events.index("r2+") < events.index("r1-")  # readers share
    assert events.index("w+") > max(events.index("r1-"), events.index("r2-"))


async def test_garbage_collection_of_expired_sessions_and_orphans(tmp_path, managers):
    host, disk = HostTier(MB), DiskTier(tmp_path / "disk", 64 * MB)
    manager = await managers.open([host, disk], disk.meta)
    keep = make_session(random_tokens(40, seed=1))
    await manager.spill("t", "keep", generation=1, **keep)
    short = make_session(random_tokens(40, seed=2))
    manifest = await manager.spill("t", "short", generation=1, ttl_s=30, **short)
    await manager.drain()
    # what a crash between block writes and the manifest commit leaves behind
    orphan_chunk = make_session(random_tokens(16, seed=3))["chunks"][0]
    await disk.put(*orphan_chunk)
    await host.put("win/t/gone/4", keep["window"])
    report = await manager.collect_garbage(now=manifest.last_access + 10)
    assert (report.expired_sessions, report.orphan_blocks) == (0, 2)
    report = await manager.collect_garbage(now=manifest.last_access + 31)
    assert report.expired_sessions == 1
    with pytest.raises(SessionNotFound):
        await manager.restore("t", "short")
    result = await manager.restore("t", "keep")
    assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in keep["chunks"]]
    held = await tier_keys(host) | await tier_keys(disk)
    assert held == {k for k, _ in keep["chunks"]} | {result.manifest.window_key}
    await managers.close(manager)


async def test_random_operations_leave_exact_accounting(tmp_path, managers):
    """Many sessions sharing prefixes, spilled, re-spilled, restored and deleted at once:
    afterwards every tier holds exactly the live sessions' blocks, then nothing."""
    tiers = [HostTier(12_000), DiskTier(tmp_path / "disk", 64 * MB)]
    manager = await managers.open(tiers, tiers[1].meta)
    rng = random.Random(11)
    prefixes = [random_tokens(32, seed=s) for s in range(3)]
    generation: dict[str, int] = {}
    live: dict[str, dict] = {}

    async def step(i: int, sid: str) -> None:
        roll = rng.random()
        if roll < 0.5:
            tokens = np.concatenate([rng.choice(prefixes), random_tokens(rng.randrange(40),
                                                                         seed=1000 + i)])
            args = make_session(tokens, window=rng.random() < 0.7)
            generation[sid] = generation.get(sid, 0) + 1
            await manager.spill("t", sid, generation=generation[sid], **args)
            live[sid] = args
        elif roll < 0.8 and sid in live:
            want = live[sid]
            result = await manager.restore("t", sid)
            assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in want["chunks"]]
        elif sid in live:
            del live[sid]
            await manager.delete("t", sid)

    for batch in range(6):  # each batch touches distinct sessions, all at once
        sids = rng.sample([f"s{n}" for n in range(16)], 10)
        await asyncio.gather(*(step(batch * 10 + i, sid) for i, sid in enumerate(sids)))
    await manager.drain()
    expected = set()
    for args in live.values():
        expected |= {k for k, _ in args["chunks"]}
    manifests = {m.session_id: m for m in await manager.list_sessions("t")}
    assert set(manifests) == set(live)
    windows = {m.window_key for m in manifests.values() if m.window_key}
    held = await tier_keys(tiers[0]) | await tier_keys(tiers[1])
    assert held == expected | windows
    for sid in list(live):
        await manager.delete("t", sid)
    await manager.drain()
    assert [t.used_bytes for t in tiers] == [0, 0]
    assert (await manager.stat()).referenced_chunks == 0
    await managers.close(manager)


async def test_concurrent_moves_under_pressure_never_return_wrong_bytes(tmp_path, managers):
    """Spills, restores, prefetches, demotions and deletes of overlapping sessions at once
    on tiers far too small: every restore is byte-identical, nothing deadlocks."""
    from kvstore.tiers.hbm import HBMTier

    tiers = [HBMTier(2500), HostTier(5000), DiskTier(tmp_path / "disk", 64 * MB)]
    manager = await managers.open(tiers, tiers[2].meta)
    prefix = random_tokens(48, seed=90)
    sessions = {f"s{i}": make_session(np.concatenate([prefix, random_tokens(16 + 9 * i,
                                                                             seed=91 + i)]))
                for i in range(8)}
    await asyncio.gather(*(manager.spill("t", sid, generation=1, **args)
                           for sid, args in sessions.items()))
    rng = random.Random(4)

    async def check(sid):
        result = await manager.restore("t", sid)
        assert [bytes(c) for c in result.chunks] == [bytes(d) for _, d in sessions[sid]["chunks"]]

    work = []
    for _ in range(40):
        sid = rng.choice(list(sessions))
        roll = rng.random()
        if roll < 0.6:
            work.append(check(sid))
        elif roll < 0.8:
            work.append(manager.prefetch("t", sid, timeout_s=30))
        else:
            work.append(manager.demote("t", sid, rng.choice(["host", "disk"])))
    await asyncio.wait_for(asyncio.gather(*work), timeout=120)
    await asyncio.gather(*(check(sid) for sid in sessions))
    await asyncio.gather(*(manager.delete("t", sid) for sid in sessions))
    await manager.drain()
    assert [t.used_bytes for t in tiers] == [0, 0, 0]
    await managers.close(manager)
