"""Listing every session of a big store (``kvtier list``, a drain, the maintenance sweep, a
start's count) decodes and opens its manifests a page at a time, giving the event loop a
turn between pages: other RPCs are served while it runs."""

from __future__ import annotations

import asyncio

from kvstore.encryption.seal import Keyring, MasterKey
from kvstore.encryption.tiers import EncryptedMetaStore
from kvstore.placement.refcount import RefLedger
from kvstore.session.catalog import Catalog
from kvstore.session.manifest import SessionManifest, manifest_key
from kvstore.session.quota import UsageLedger
from kvstore.tiers.base import SCAN_PAGE, SCAN_PAGE_BYTES, MemoryMetaStore, MetaStore

SESSIONS = 3 * SCAN_PAGE + 7


async def fill(meta: MetaStore) -> None:
    await meta.commit({
        manifest_key("t", f"s{i:05d}"): SessionManifest(
            tenant="t", session_id=f"s{i:05d}", layout_id="l", generation=1,
            token_ids=[1, 2, 3], chunk_keys=(), chunk_sizes=()).encode()
        for i in range(SESSIONS)})


async def turns_given_during(work) -> tuple[object, int]:
    """What ``work`` returned, and how many turns another task had while it ran."""
    turns = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal turns
        while not done.is_set():
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = turns
    try:
        result = await work
    finally:
        done.set()
        await task
    return result, turns - start


async def test_listing_manifests_gives_the_loop_a_turn_between_pages():
    meta = MemoryMetaStore()  # its scan never yields: any turn is the catalog's
    await fill(meta)
    catalog = Catalog(meta, RefLedger(meta), UsageLedger())
    listed, turns = await turns_given_during(catalog.manifests())
    assert [m.session_id for m in listed] == [f"s{i:05d}" for i in range(SESSIONS)]
    assert turns >= SESSIONS // SCAN_PAGE


async def test_opening_sealed_manifests_gives_the_loop_a_turn_between_pages():
    meta = EncryptedMetaStore(MemoryMetaStore(), Keyring([MasterKey("k1", bytes(32))]))
    await fill(meta)
    records, turns = await turns_given_during(meta.scan("manifest"))
    assert len(records) == SESSIONS
    assert SessionManifest.decode(records[0][1]).session_id == "s00000"
    assert turns >= SESSIONS // SCAN_PAGE


async def test_big_manifests_are_paced_by_their_bytes_too():
    meta = MemoryMetaStore()
    big = list(range(SCAN_PAGE_BYTES // 4 // 2))  # two records a page at most
    await meta.commit({
        manifest_key("t", f"s{i}"): SessionManifest(
            tenant="t", session_id=f"s{i}", layout_id="l", generation=1,
            token_ids=big, chunk_keys=(), chunk_sizes=()).encode()
        for i in range(6)})
    catalog = Catalog(meta, RefLedger(meta), UsageLedger())
    listed, turns = await turns_given_during(catalog.manifests())
    assert len(listed) == 6 and len(listed[5].token_ids) == len(big)
    assert turns >= 3
