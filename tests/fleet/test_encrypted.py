"""A fleet with encryption at rest: two real servers over one moto S3 bucket and one
Redis, metadata = "shared", both holding the same keyring. The bucket holds only sealed
values (manifests and chunks alike: no token id, no KV byte in clear), any node resumes
any session bit-exact, and a node holding another key reads nothing of it."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import boto3
import pytest
import redis
import torch

from kvstore.encryption.seal import MAGIC
from kvstore.format.errors import ChunkCorrupt, DataLoss, StaleGeneration
from kvtier import AsyncClient
from tests.support.fleet import SPEC, TOKENS, assert_persistent, assert_same_window, fleet

KEY = base64.b64encode(bytes(range(32))).decode()


@pytest.fixture
def sealed_fleet_env(fleet_env):
    return {**fleet_env, "encryption_key": KEY}


def bucket_objects(endpoint: str, bucket: str, credentials: dict) -> dict[str, bytes]:
    s3 = boto3.client("s3", endpoint_url=endpoint, **credentials)
    names = [item["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
             for item in page.get("Contents", [])]
    return {name: s3.get_object(Bucket=bucket, Key=name)["Body"].read() for name in names}


async def test_a_sealed_fleet_resumes_anywhere_and_the_bucket_holds_no_clear_byte(
        tmp_path: Path, sealed_fleet_env, redis_server, model_state, s3_server, s3_bucket,
        s3_credentials):
    _, ids, chunks, tail, window = model_state
    async with (fleet(tmp_path, sealed_fleet_env, redis_server, names="ab") as nodes,
                AsyncClient(nodes["a"]) as on_a, AsyncClient(nodes["b"]) as on_b):
        spilled = await on_a.spill("acme", "s1", SPEC, ids, chunks=chunks, tail=tail,
                                   window=window, generation=1, ack="durable")
        assert spilled.durable
        moved = await on_b.resume("acme", "s1", replay_tokens=TOKENS)
        assert moved.replayed
        assert_persistent(moved, chunks, tail)
        assert_same_window(moved.window_blob, window, moved.token_ids)
        # generations are still compare-and-swap across nodes, on sealed manifests
        await on_b.spill("acme", "s1", SPEC, ids, chunks=chunks, tail=tail,
                         generation=2, ack="durable")
        with pytest.raises(StaleGeneration):  # another generation 2 than b's
            await on_a.spill("acme", "s1", SPEC, ids, chunks=chunks, tail=tail,
                             window=window, generation=2, ack="durable")
        assert (await on_a.restore("acme", "s1", want_window=False)).generation == 2

    stored = bucket_objects(s3_server, s3_bucket, s3_credentials)
    manifests = {k: v for k, v in stored.items() if k.endswith(".kvsm")}
    data = {k: v for k, v in stored.items() if k.endswith((".bin", ".zst"))}
    assert manifests and data
    token_bytes = [ids.to(dtype).numpy().tobytes()[:64] for dtype in (torch.int32, torch.int64)]
    for name, value in {**manifests, **data}.items():
        assert value.startswith(MAGIC), name
        assert not any(clear in value for clear in token_bytes), name
    cached = redis.Redis.from_url(redis_server)
    values = [cached.get(key) for key in cached.scan_iter() if cached.type(key) == b"string"]
    assert values  # the shared hot tier holds the chunks, sealed too
    for chunk in chunks:
        assert not any(bytes(chunk)[64:128] in value for value in [*data.values(), *values])


async def test_a_node_with_another_key_reads_nothing_of_a_sealed_fleet(
        tmp_path: Path, sealed_fleet_env, redis_server, model_state):
    _, ids, chunks, tail, window = model_state
    other = {**sealed_fleet_env, "encryption_key": base64.b64encode(os.urandom(32)).decode()}
    async with (fleet(tmp_path, sealed_fleet_env, redis_server, names="a") as nodes,
                AsyncClient(nodes["a"]) as on_a):
        await on_a.spill("acme", "s1", SPEC, ids, chunks=chunks, tail=tail,
                         generation=1, ack="durable")
    async with (fleet(tmp_path / "other", other, redis_server, names="z") as nodes,
                AsyncClient(nodes["z"]) as on_z):
        with pytest.raises((DataLoss, ChunkCorrupt)):  # DATA_LOSS, naming the manifest
            await on_z.restore("acme", "s1", want_window=False)
