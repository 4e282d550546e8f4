"""Exact accounting: after thousands of seeded random puts, overwrites and deletes, every
tier's ``used_bytes`` equals the sum of the live values' sizes and what its medium really
holds, measured independently of the tier (tensor storage, STRLEN, file sizes, S3 listing).
"""

from __future__ import annotations

import os
import random

import boto3
import pytest
import redis

from kvstore.format.errors import TierFull
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.hbm import HBMTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.object import ObjectTier, ObjectTierConfig
from kvstore.tiers.redis import RedisTier, RedisTierConfig

KEYS = 120
MAX_VALUE = 3000
CAPACITY = 20 * MAX_VALUE  # a sixth of what the key space could hold: some puts fail


def _redis_medium(url: str, prefix: str):
    async def held() -> int:
        with redis.Redis.from_url(url) as client:
            return sum(client.strlen(k) for k in client.scan_iter(match=prefix + "*"))
    return held


def _dir_medium(root):
    async def held() -> int:
        total = 0
        for directory, _dirs, files in os.walk(root):
            if os.path.basename(directory) != ".tmp":
                total += sum(os.path.getsize(os.path.join(directory, f)) for f in files)
        return total
    return held


def _s3_medium(endpoint: str, bucket: str, credentials: dict):
    async def held() -> int:
        client = boto3.client("s3", endpoint_url=endpoint, **credentials)
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sum(item["Size"] for page in pages for item in page.get("Contents", []))
    return held


@pytest.fixture(params=["host", "arena", "hbm", "redis", "object-local", "object-s3", "disk"])
def tier_under_test(request, tmp_path):
    """(tier, medium_bytes coroutine function, number of operations)."""
    kind = request.param
    if kind == "arena":
        tier = ArenaTier(CAPACITY)
        return tier, tier.held_bytes, 4000
    if kind in ("host", "hbm"):
        tier = HostTier(CAPACITY) if kind == "host" else HBMTier(CAPACITY)
        return tier, tier.held_bytes, 4000
    if kind == "redis":
        url = request.getfixturevalue("redis_server")
        tier = RedisTier(url, CAPACITY, RedisTierConfig(prefix="acct:"))
        return tier, _redis_medium(url, "acct:"), 2000
    if kind == "object-local":
        root = tmp_path / "objects"
        return ObjectTier(root, CAPACITY), _dir_medium(root), 400
    if kind == "object-s3":
        endpoint = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        credentials = request.getfixturevalue("s3_credentials")
        tier = ObjectTier(f"s3://{bucket}/", CAPACITY,
                          ObjectTierConfig(endpoint_url=endpoint, **credentials))
        return tier, _s3_medium(endpoint, bucket, credentials), 200
    tier = DiskTier(tmp_path / "disk", CAPACITY)
    # An append-only log holds dead records until compaction: its medium check is that
    # every live value reads back, done below for every tier.
    return tier, None, 1500


async def test_used_bytes_match_live_values_and_medium(tier_under_test):
    tier, medium_bytes, operations = tier_under_test
    rng = random.Random(20261129)
    live: dict[str, bytes] = {}
    full = 0
    try:
        for step in range(operations):
            key = f"k{rng.randrange(KEYS)}"
            roll = rng.random()
            if roll < 0.6:
                value = rng.randbytes(rng.randrange(MAX_VALUE + 1))
                try:
                    await tier.put(key, value)
                except TierFull:
                    full += 1
                else:
                    live[key] = value
            elif roll < 0.9:
                freed = await tier.delete(key)
                assert freed == len(live.pop(key, b""))
            else:
                assert await tier.contains(key) == (key in live)
            if step % 97 == 0:
                assert tier.used_bytes == sum(map(len, live.values()))
        assert full > 0  # the capacity limit was really exercised
        assert tier.used_bytes == sum(map(len, live.values()))
        assert tier.used_bytes <= tier.capacity_bytes
        if medium_bytes is not None:
            assert await medium_bytes() == tier.used_bytes
        for key, value in live.items():
            assert bytes(await tier.get(key)) == value
        for key in list(live):
            await tier.delete(key)
        assert tier.used_bytes == 0
        if medium_bytes is not None:
            assert await medium_bytes() == 0
    finally:
        await tier.close()
