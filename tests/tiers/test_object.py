"""ObjectTier on a local directory and on moto's S3 server over HTTP."""

from __future__ import annotations

import os
import uuid

import boto3
import pytest

from kvstore.format.errors import ChunkNotFound, InvalidRequest, TierFull, TierUnavailable
from kvstore.tiers.object import ObjectTier, ObjectTierConfig


@pytest.fixture(params=["local", "s3"])
def make_tier(request, tmp_path, opened):
    """``make_tier(capacity, **config) -> ObjectTier``, on both backends, same place each
    call (so a second tier sees what the first wrote); closed when the test ends."""
    if request.param == "local":
        return lambda capacity, **config: ObjectTier(tmp_path / "objects", capacity,
                                                     ObjectTierConfig(**config))
    endpoint = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    credentials = request.getfixturevalue("s3_credentials")
    return lambda capacity, **config: opened.adopt(ObjectTier(
        f"s3://{bucket}/chunks", capacity,
        ObjectTierConfig(endpoint_url=endpoint, **credentials, **config)))


async def test_round_trip_overwrite_delete(make_tier):
    tier = make_tier(1000)
    assert tier.durable and not tier.holds_window
    await tier.put("a/b:c", b"1" * 300)  # any string is a key, separators included
    await tier.put("x", bytearray(b"2" * 200))
    assert await tier.get("a/b:c") == b"1" * 300
    assert tier.used_bytes == 500 == await tier.held_bytes()
    await tier.put("a/b:c", b"3" * 100)
    assert tier.used_bytes == 300 == await tier.held_bytes()
    assert sorted([k async for k in tier.keys()]) == ["a/b:c", "x"]  # noqa: SIM118
    stats = await tier.stats()
    assert (stats.items, stats.used_bytes, stats.available) == (2, 300, True)
    assert await tier.contains("x") and not await tier.contains("nope")
    assert await tier.delete("x") == 200
    assert await tier.delete("x") == 0
    with pytest.raises(ChunkNotFound):
        await tier.get("x")
    assert tier.used_bytes == 100 == await tier.held_bytes()


async def test_capacity_is_enforced_and_keeps_the_old_value(make_tier):
    tier = make_tier(1000)
    await tier.put("a", b"a" * 600)
    with pytest.raises(TierFull):
        await tier.put("b", b"b" * 401)
    with pytest.raises(TierFull):
        await tier.put("a", b"c" * 1001)
    assert await tier.get("a") == b"a" * 600
    assert tier.used_bytes == 600 == await tier.held_bytes()


async def test_a_new_tier_loads_accounting_from_the_medium(make_tier):
    first = make_tier(10_000)
    await first.put("one", b"1" * 100)
    await first.put("two", b"2" * 50)
    second = make_tier(10_000)
    assert await second.get("one") == b"1" * 100  # first use loads the listing
    assert second.used_bytes == 150
    assert await second.resync() == 150


async def test_compression_is_accounted_as_stored_and_read_back(make_tier):
    tier = make_tier(1 << 20, compression_level=3)
    value = b"compressible " * 1000
    await tier.put("z", value)
    assert await tier.get("z") == value
    assert 0 < tier.used_bytes < len(value) // 10
    assert tier.used_bytes == await tier.held_bytes()
    plain = make_tier(1 << 20)  # compression turned off: still reads the old object
    assert await plain.get("z") == value
    await plain.put("z", b"now raw")  # rewrites it raw and drops the compressed object
    assert await plain.get("z") == b"now raw"
    assert plain.used_bytes == 7 == await plain.held_bytes()


async def test_bad_input(make_tier):
    tier = make_tier(1000)
    with pytest.raises(InvalidRequest):
        await tier.put("", b"x")
    with pytest.raises(InvalidRequest):
        await tier.put("k" * 2000, b"x")
    with pytest.raises(InvalidRequest):
        await tier.put("k", 12)  # type: ignore[arg-type]
    assert tier.used_bytes == 0


async def test_large_values_use_the_transfer_manager(make_tier):
    tier = make_tier(1 << 24, transfer_threshold_bytes=1 << 20, transfer_chunk_bytes=5 << 20)
    value = os.urandom(6 << 20)  # above the threshold: multipart upload, ranged download
    await tier.put("big", value)
    assert await tier.get("big") == value
    assert tier.used_bytes == len(value) == await tier.held_bytes()


async def test_local_writes_leave_no_temp_files_and_clear_crash_debris(tmp_path):
    root = tmp_path / "objects"
    tier = ObjectTier(f"file://{root}", 1000)
    await tier.put("k", b"v" * 10)
    assert list((root / ".tmp").iterdir()) == []
    (root / ".tmp" / "half-written").write_bytes(b"torn")  # as a crash mid-write leaves
    reopened = ObjectTier(root, 1000)
    assert reopened.used_bytes == 10  # a local tier loads its accounting when built
    assert list((root / ".tmp").iterdir()) == []
    assert await reopened.get("k") == b"v" * 10
    assert reopened.used_bytes == 10


async def test_corrupt_compressed_object_is_reported(tmp_path):
    from kvstore.format.errors import ChunkCorrupt

    tier = ObjectTier(tmp_path, 1000, ObjectTierConfig(compression_level=1))
    await tier.put("k", b"v" * 100)
    [path] = [p for p in tmp_path.rglob("k.zst")]
    path.write_bytes(b"not zstd at all")
    with pytest.raises(ChunkCorrupt):
        await tier.get("k")


async def test_unreachable_endpoint_is_unavailable(s3_credentials, opened, down_server):
    config = ObjectTierConfig(endpoint_url=f"http://{down_server}",
                              connect_timeout_s=0.2, max_attempts=1, **s3_credentials)
    tier = opened.adopt(ObjectTier("s3://bucket/prefix", 1000, config))
    with pytest.raises(TierUnavailable):
        await tier.put("k", b"v")
    with pytest.raises(TierUnavailable):
        await tier.get("k")
    assert not tier.health.available


async def test_missing_bucket_is_unavailable_and_errors_are_not_misreported(
        s3_server, s3_credentials, opened):
    tier = opened.adopt(ObjectTier("s3://no-such-bucket-here", 1000,
                                   ObjectTierConfig(endpoint_url=s3_server, **s3_credentials)))
    with pytest.raises(TierUnavailable):
        await tier.get("k")
    client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
    client.create_bucket(Bucket="no-such-bucket-here")
    assert await tier.resync() == 0  # recovers once the bucket exists
    with pytest.raises(ChunkNotFound):
        await tier.get("k")
    assert tier.health.available


def test_bad_urls():
    with pytest.raises(InvalidRequest):
        ObjectTier("http://example/x", 10)
    with pytest.raises(InvalidRequest):
        ObjectTier("s3:///prefix", 10)


async def test_a_missing_bucket_fails_every_call_by_name_until_it_exists(
        s3_server, s3_credentials, opened):
    bucket = f"kvtier-missing-{uuid.uuid4().hex[:12]}"
    tier = opened.adopt(ObjectTier(f"s3://{bucket}/chunks", 1000, ObjectTierConfig(
        endpoint_url=s3_server, max_attempts=1, **s3_credentials)))
    calls = {"put": lambda: tier.put("k", b"v"), "get": lambda: tier.get("k"),
             "delete": lambda: tier.delete("k"), "contains": lambda: tier.contains("k"),
             "resync": tier.resync, "held_bytes": tier.held_bytes}
    for _ in range(2):  # nothing is cached: every call asks S3 again
        for name, call in calls.items():
            with pytest.raises(TierUnavailable) as raised:
                await call()
            message = str(raised.value)
            assert repr(bucket) in message and "does not exist" in message, name
            assert s3_credentials["aws_secret_access_key"] not in message, name
    assert not tier.health.available
    boto3.client("s3", endpoint_url=s3_server, **s3_credentials).create_bucket(Bucket=bucket)
    await tier.put("k", b"v")  # no restart, no resync: the next call finds the bucket
    assert await tier.get("k") == b"v"
    assert tier.health.available and tier.used_bytes == 1


async def test_a_bucket_deleted_under_a_loaded_tier_is_unavailable_by_name(
        s3_server, s3_credentials, s3_bucket, opened):
    client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
    tier = opened.adopt(ObjectTier(f"s3://{s3_bucket}/chunks", 1000, ObjectTierConfig(
        endpoint_url=s3_server, max_attempts=1, **s3_credentials)))
    await tier.put("k", b"v")
    client.delete_object(Bucket=s3_bucket, Key="chunks/k.bin")
    client.delete_bucket(Bucket=s3_bucket)
    for call in (lambda: tier.put("k2", b"v2"), lambda: tier.get("k"),
                 lambda: tier.delete("k")):
        with pytest.raises(TierUnavailable, match=f"{s3_bucket!r} does not exist"):
            await call()
    client.create_bucket(Bucket=s3_bucket)
    await tier.put("k2", b"v2")
    assert await tier.get("k2") == b"v2"
