"""The ``Tier`` contract (kvstore.tiers.base), one suite over every implementation: the HBM
tier (on the CPU), the host tier (in torch memory and in shared-memory slabs), Redis (a
real redis-server), the disk tier, the object tier on a local directory and on moto's S3
server, and the encrypting tier over the object tier. Each promise of the interface is
asserted the same way on each of them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from kvstore.encryption.seal import Keyring, MasterKey
from kvstore.encryption.tiers import BlockDomain, BlockDomains, EncryptedTier
from kvstore.format.errors import ChunkNotFound, InvalidRequest, TierFull, TierUnavailable
from kvstore.format.keys import dedupe_scope
from kvstore.format.shm_names import available as shm_available
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.object import ObjectTier, ObjectTierConfig
from kvstore.tiers.redis import RedisTier, RedisTierConfig

CAPACITY = 8192
# Every key the suite uses: separators included, since any non-empty string is a key.
KEYS = ["a", "b", "c", "d", "ns/chunk:0", "ns/chunk:1", "missing", "big", "small"]
KINDS = ["hbm", "host", "arena", "redis", "disk", "object-local", "object-s3", "encrypted-object"]


@dataclass
class Case:
    """How to build one implementation at a fixed place (a second build sees what the
    first one stored, where the medium keeps it), and what it does beyond the contract."""

    build: Callable[[], Tier]
    overhead: int = 0  # bytes each value takes in the medium beyond its length
    expires: bool = True  # ttl_s is enforced (the object tier accepts it, compaction acts)

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[Tier]:
        tier = self.build()
        try:
            yield tier
        finally:
            await tier.close()


def encrypted(inner: Callable[[], Tier]) -> Case:
    keyring = Keyring([MasterKey("contract", bytes(range(32)))])
    domains = BlockDomains()
    domain = BlockDomain(dedupe_scope("acme"), 7)
    for key in KEYS:  # as the spill that brings each block in would claim it
        domains.claim(key, domain)
    overhead = len(keyring.seal("a", domain.scope, b"", domain.layout_hash))
    return Case(lambda: EncryptedTier(inner(), keyring, domains), overhead=overhead,
                expires=False)


@pytest.fixture(params=KINDS)
def case(request, tmp_path) -> Case:
    kind = request.param
    if kind == "hbm":
        return Case(lambda: HBMTier(CAPACITY, device="cpu"))
    if kind == "host":
        return Case(lambda: HostTier(CAPACITY, pin_memory=False))
    if kind == "arena":
        if not shm_available():
            pytest.skip("no /dev/shm")
        return Case(lambda: ArenaTier(CAPACITY))
    if kind == "redis":
        url = request.getfixturevalue("redis_server")
        return Case(lambda: RedisTier(url, CAPACITY, RedisTierConfig(prefix="contract:")))
    if kind == "disk":
        return Case(lambda: DiskTier(tmp_path / "disk", CAPACITY, segment_bytes=1 << 20,
                                     map_size=16 << 20))
    if kind == "object-local":
        return Case(lambda: ObjectTier(tmp_path / "objects", CAPACITY), expires=False)
    if kind == "object-s3":
        endpoint = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        config = ObjectTierConfig(endpoint_url=endpoint,
                                  **request.getfixturevalue("s3_credentials"))
        return Case(lambda: ObjectTier(f"s3://{bucket}/contract", CAPACITY, config),
                    expires=False)
    assert kind == "encrypted-object"
    return encrypted(lambda: ObjectTier(tmp_path / "sealed", CAPACITY))


async def listed(tier: Tier) -> set[str]:
    return {key async for key in tier.keys()}  # noqa: SIM118 - an async iterator


async def test_a_value_comes_back_whole_and_an_overwrite_replaces_it(case):
    async with case.open() as tier:
        await tier.put("a", b"\x00\x01" * 100)
        await tier.put("ns/chunk:0", bytearray(b"x" * 333))
        await tier.put("b", memoryview(bytes(range(256))))
        assert bytes(await tier.get("a")) == b"\x00\x01" * 100
        assert bytes(await tier.get("ns/chunk:0")) == b"x" * 333
        assert bytes(await tier.get("b")) == bytes(range(256))
        assert tier.used_bytes == 200 + 333 + 256 + 3 * case.overhead
        assert await tier.contains("a") and not await tier.contains("missing")

        await tier.put("a", b"shorter")  # replaces the value, and its size in the account
        assert bytes(await tier.get("a")) == b"shorter"
        assert tier.used_bytes == 7 + 333 + 256 + 3 * case.overhead
        assert tier.free_bytes <= CAPACITY - tier.used_bytes


async def test_a_missing_key_is_chunk_not_found(case):
    async with case.open() as tier:
        with pytest.raises(ChunkNotFound):
            await tier.get("missing")
        await tier.put("a", b"1" * 10)
        await tier.delete("a")
        with pytest.raises(ChunkNotFound):
            await tier.get("a")
        assert not await tier.contains("a")


async def test_get_many_answers_in_order_with_each_missing_key_its_error(case):
    async with case.open() as tier:
        await tier.put("a", b"A" * 40)
        await tier.put("c", b"C" * 70)
        got = await tier.get_many(["c", "missing", "a", "c"])
        assert len(got) == 4
        assert bytes(got[0]) == b"C" * 70 and bytes(got[3]) == b"C" * 70
        assert isinstance(got[1], ChunkNotFound)
        assert bytes(got[2]) == b"A" * 40
        assert await tier.get_many([]) == []


async def test_delete_returns_the_bytes_freed_and_is_idempotent(case):
    async with case.open() as tier:
        await tier.put("a", b"1" * 300)
        await tier.put("b", b"2" * 100)
        assert await tier.delete("a") == 300 + case.overhead
        assert await tier.delete("a") == 0
        assert await tier.delete("missing") == 0
        assert tier.used_bytes == 100 + case.overhead
        assert await listed(tier) == {"b"}


async def test_keys_lists_every_key_held_and_stats_agree(case):
    async with case.open() as tier:
        assert await listed(tier) == set() and await tier.count() == 0
        values = {"a": b"1" * 10, "ns/chunk:0": b"2" * 20, "ns/chunk:1": b"3" * 30}
        for key, value in values.items():
            await tier.put(key, value)
        await tier.put("a", b"4" * 15)  # an overwrite adds no key
        assert await listed(tier) == set(values)
        assert await tier.count() == 3
        stats = await tier.stats()
        assert stats.name == tier.name and stats.items == 3 and stats.available
        assert stats.capacity_bytes == CAPACITY
        assert stats.used_bytes == tier.used_bytes == 15 + 20 + 30 + 3 * case.overhead


async def test_a_put_that_does_not_fit_is_tier_full_and_changes_nothing(case):
    async with case.open() as tier:
        big = b"B" * (CAPACITY // 2)
        await tier.put("big", big)
        used = tier.used_bytes
        with pytest.raises(TierFull):
            await tier.put("small", b"S" * (CAPACITY // 2 + 1))
        assert tier.used_bytes == used
        assert not await tier.contains("small") and await listed(tier) == {"big"}
        assert bytes(await tier.get("big")) == big

        # A replacement counts only its growth; then, once deleted, the room is back.
        await tier.put("big", b"b" * (CAPACITY - 2 * case.overhead - 100))
        await tier.delete("big")
        await tier.put("small", b"S" * (CAPACITY // 2 + 1))
        assert bytes(await tier.get("small")) == b"S" * (CAPACITY // 2 + 1)


async def test_a_value_put_with_a_ttl_expires_and_the_others_stay(case):
    async with case.open() as tier:
        for bad in (0, -1.0):
            if case.expires:
                with pytest.raises(InvalidRequest):
                    await tier.put("a", b"x", ttl_s=bad)
        await tier.put("a", b"short-lived", ttl_s=0.05)
        await tier.put("b", b"kept")
        if not case.expires:  # accepted, and left to the compaction job
            assert bytes(await tier.get("a")) == b"short-lived"
            return
        deadline = time.monotonic() + 10
        while True:
            try:
                await tier.get("a")
            except ChunkNotFound:
                break
            assert time.monotonic() < deadline, "the value never expired"
            await asyncio.sleep(0.02)
        assert bytes(await tier.get("b")) == b"kept"


async def test_a_tier_that_expires_values_says_the_time_left(case):
    """``ttl_s``: what a rewrite keeps (a reseal puts the value back with it)."""
    async with case.open() as tier:
        await tier.put("a", b"t", ttl_s=600)
        await tier.put("b", b"k")
        left = await tier.ttl_s("a")
        if not case.expires:
            assert left is None
            return
        assert left is not None and 590 < left <= 600
        assert await tier.ttl_s("b") is None
        with pytest.raises(ChunkNotFound):
            await tier.ttl_s("missing")


async def test_a_durable_tier_holds_its_values_after_close(case):
    async with case.open() as tier:
        await tier.put("a", b"kept" * 50)
        durable = tier.durable
        assert tier.holds_window == (tier.name in ("hbm", "host"))  # only memory tiers
    async with case.open() as reopened:
        if durable:
            assert bytes(await reopened.get("a")) == b"kept" * 50
            assert reopened.used_bytes == 200 + case.overhead
        elif reopened.name != "redis":  # in process memory: gone with the instance
            assert await listed(reopened) == set() and reopened.used_bytes == 0


async def test_an_empty_key_is_refused(case):
    async with case.open() as tier:
        # the encrypting tier refuses first a key it knows no dedupe domain for
        refusal = TierUnavailable if isinstance(tier, EncryptedTier) else InvalidRequest
        with pytest.raises(refusal):
            await tier.put("", b"x")
        assert await listed(tier) == set()
