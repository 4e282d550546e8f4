"""The fleet's sweep (kvstore.fleet.gc, docs/fleet.md "Garbage collection"): it deletes only
collectable chunks (unnamed, past grace and retention), a spill deduping a marked chunk
claims it, a node puts back a chunk a sweep deleted under its belief, one sweep runs at a
time and a dead one is taken over, and sweeps racing deduping spills for N rounds delete
no chunk a manifest names. Real stores (``open_manager``) over moto's S3 server."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter

import pytest

from kvstore.fleet.epochs import read_epoch
from kvstore.fleet.gc import collect
from kvstore.format.errors import Busy, DataLoss, TierUnavailable
from kvstore.session.manifest import SessionManifest
from tests.support.fleet import FAST, bucket_chunks, fleet_nodes, named_chunks
from tests.support.manager import make_session, random_tokens


def session(i: int) -> dict:
    return make_session(random_tokens(64, i), seed=i, window=False, tenant="acme")


def chunk_keys(content: dict) -> set[str]:
    return {key for key, _ in content["chunks"]}


async def restored(node, name: str) -> list[bytes]:
    return [bytes(x) for x in (await node.restore("acme", name)).chunks]


def sent(content: dict) -> list[bytes]:
    return [bytes(data) for _, data in content["chunks"]]


async def wait_for_state(meta, state: str) -> None:
    while (await read_epoch(meta.io, meta.paths))[0].state != state:
        await asyncio.sleep(0.02)


async def test_a_sweep_deletes_only_unnamed_chunks_and_a_dry_run_deletes_none(node_config):
    async with fleet_nodes(node_config) as make_node:
        a = await make_node("a")
        kept, dropped = session(1), session(2)
        await a.spill("acme", "kept", generation=1, ack="durable", **kept)
        await a.spill("acme", "dropped", generation=1, ack="durable", **dropped)
        await a.delete("acme", "dropped")
        before = await bucket_chunks(a.meta)
        assert chunk_keys(kept) | chunk_keys(dropped) <= before

        dry = await collect(a.meta, FAST, dry_run=True)
        assert dry.candidates == len(chunk_keys(dropped)) and dry.deleted == 0
        assert dry.live == len(chunk_keys(kept))
        assert await bucket_chunks(a.meta) == before

        report = await collect(a.meta, FAST)
        assert report.deleted == len(chunk_keys(dropped)) and report.epoch == 1
        after = await bucket_chunks(a.meta)
        assert chunk_keys(kept) <= after and not chunk_keys(dropped) & after
        assert await restored(a, "kept") == sent(kept)
        assert (await collect(a.meta, FAST)).candidates == 0  # nothing left to take


async def test_unnamed_chunks_stay_for_the_retention_period(node_config):
    async with fleet_nodes(node_config) as make_node:
        a = await make_node("a")
        content = session(3)
        await a.spill("acme", "s", generation=1, ack="durable", **content)
        await a.delete("acme", "s")
        timing = dataclasses.replace(FAST, retain_s=1.5)
        first = await collect(a.meta, timing)
        assert first.kept_retained == len(chunk_keys(content)) and first.deleted == 0
        assert chunk_keys(content) <= await bucket_chunks(a.meta)
        await asyncio.sleep(2.0)  # past retain_s since the first sweep saw them unnamed
        second = await collect(a.meta, timing)
        assert second.deleted == len(chunk_keys(content))
        assert not chunk_keys(content) & await bucket_chunks(a.meta)


async def test_a_spill_deduping_marked_chunks_claims_them_and_the_sweep_keeps_them(node_config):
    async with fleet_nodes(node_config) as make_node:
        b = await make_node("b")
        content = session(4)
        await b.spill("acme", "old", generation=1, ack="durable", **content)
        await b.delete("acme", "old")
        a = await make_node("a")  # learns the bucket's chunks at open: the spill dedupes
        slow = dataclasses.replace(FAST, request_margin_s=2.0)  # a long marking phase
        sweep = asyncio.create_task(collect(b.meta, slow))
        await wait_for_state(b.meta, "marking")
        manifest = await a.spill("acme", "new", generation=1, ack="durable", **content)
        assert manifest.receipt.chunks_deduped == len(content["chunks"])
        report = await sweep
        assert report.claimed == len(chunk_keys(content)) and report.deleted == 0
        assert chunk_keys(content) <= await bucket_chunks(b.meta)
        assert await restored(b, "new") == sent(content)


async def test_a_node_puts_back_a_collected_chunk_it_still_believed_held(node_config):
    async with fleet_nodes(node_config) as make_node:
        a = await make_node("a", retain_unreferenced=True)  # its host tier keeps the bytes
        b = await make_node("b")
        content = session(5)
        await a.spill("acme", "s", generation=1, ack="durable", **content)
        await a.delete("acme", "s")
        assert (await collect(b.meta, FAST)).deleted == len(chunk_keys(content))
        assert not chunk_keys(content) & await bucket_chunks(b.meta)
        by_key = dict(content, chunks=[(key, None) for key, _ in content["chunks"]])
        await a.spill("acme", "again", generation=1, ack="durable", **by_key)
        assert chunk_keys(content) <= await bucket_chunks(b.meta)  # put back before the ack
        assert await restored(b, "again") == sent(content)


async def test_one_sweep_at_a_time_and_a_dead_one_is_taken_over(node_config):
    async with fleet_nodes(node_config) as make_node:
        a = await make_node("a")
        content = session(6)
        await a.spill("acme", "s", generation=1, ack="durable", **content)
        await a.delete("acme", "s")
        slow = dataclasses.replace(FAST, request_margin_s=3.0)
        first = asyncio.create_task(collect(a.meta, slow))
        await wait_for_state(a.meta, "marking")
        with pytest.raises(Busy):
            await collect(a.meta, FAST)
        first.cancel()  # the sweeper dies while marking
        with pytest.raises(asyncio.CancelledError):
            await first
        short_lease = dataclasses.replace(FAST, lease_s=0.6)
        await asyncio.sleep(short_lease.lease_s + short_lease.request_margin_s + 1.0)
        report = await collect(a.meta, short_lease)  # takes over: waits out the mark, deletes
        assert report.epoch == 1 and report.deleted == len(chunk_keys(content))
        epoch, _ = await read_epoch(a.meta.io, a.meta.paths)
        assert (epoch.epoch, epoch.state) == (1, "done")


ROUNDS = 6


async def test_sweeps_racing_spills_that_dedupe_old_chunks_delete_no_live_chunk(node_config):
    """Each round a sweep marks every unnamed chunk while two nodes spill, at random
    moments around its phases, sessions whose chunks are exactly those (sent with their
    bytes: the nodes dedupe against the bucket). Acknowledged spills must restore
    bit-exact on the other node, and every manifest's chunks must be in the bucket."""
    async with fleet_nodes(node_config) as make_node:
        b = await make_node("b")
        contents = [session(10 + i) for i in range(4)]
        for i, content in enumerate(contents):
            await b.spill("acme", f"old{i}", generation=1, ack="durable", **content)
            await b.delete("acme", f"old{i}")  # its chunks stay in the bucket, unnamed
        a, c = await make_node("a"), await make_node("c")
        rng = random.Random(14)
        totals: Counter[str] = Counter()

        async def spill_at(node, name: str, content: dict, delay: float) -> SessionManifest:
            await asyncio.sleep(delay)
            return await node.spill("acme", name, generation=1, ack="durable", **content)

        for r in range(ROUNDS):
            jobs = [(node, f"r{r}n{j}", contents[(r + j) % 4]) for j, node in
                    enumerate((a, c, a, c, a, c))]
            sweep, *outcomes = await asyncio.gather(
                collect(b.meta, FAST),
                *(spill_at(node, name, content, rng.uniform(0.0, 1.5))
                  for node, name, content in jobs), return_exceptions=True)
            assert not isinstance(sweep, BaseException), sweep
            totals.update(claimed=sweep.claimed, deleted=sweep.deleted)
            held = await bucket_chunks(b.meta)
            for key, names in (await named_chunks(b.meta)).items():
                assert names <= held, (r, key, names - held)
            for (node, name, content), outcome in zip(jobs, outcomes, strict=True):
                if isinstance(outcome, BaseException):  # refused, never acknowledged
                    assert isinstance(outcome, (DataLoss, TierUnavailable)), outcome
                    continue
                totals["acked"] += 1
                assert await restored(c if node is a else a, name) == sent(content)
                await node.delete("acme", name)  # unnamed again for the next round's sweep
        assert totals["claimed"] > 0 and totals["deleted"] > 0, totals
        assert totals["acked"] >= ROUNDS * 3, totals


async def test_a_sweep_reports_each_step_and_its_mark_wait_as_it_goes(node_config,
                                                                       monkeypatch):
    """``progress`` hears each step when it starts, and what is left of the mark wait
    while the sweep sleeps it out (the long silent part of a real sweep)."""
    from kvstore.fleet import gc

    monkeypatch.setattr(gc, "PROGRESS_EVERY_S", 0.1)
    heard: list[str] = []
    async with fleet_nodes(node_config) as make_node:
        a = await make_node("a")
        await a.spill("acme", "dropped", generation=1, ack="durable", **session(2))
        await a.delete("acme", "dropped")
        slow = dataclasses.replace(FAST, request_margin_s=0.5)  # a mark wait of 1 s
        report = await collect(a.meta, slow, progress=heard.append)
    assert report.deleted > 0
    assert heard[0] == "listing the bucket's chunks"
    assert any("candidates marked in epoch 1" in line for line in heard)
    assert sum("s left" in line for line in heard) >= 3  # about one per 0.1 s of 1 s
    assert heard[-2].startswith("deleting") and heard[-1].startswith("done:")
