"""The hot-tier fleet tests' nodes: stores (``open_manager``) of three nodes sharing a
bucket on moto's S3 server and a Redis Cluster as their hot tier, closed on exit."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest

from kvstore.session.manager import TierManager
from services.server.config import ServerConfig
from services.server.store import open_manager
from tests.support.fleet import shared_config

PREFIX = "kvtier:"  # ServerConfig.redis_prefix


@pytest.fixture
def node_config(tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch):
    """``make(node, redis_url, **extra) -> ServerConfig``: a shared-metadata node over the
    test's bucket with ``redis_url`` as its hot tier (import the fixture to use it)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])

    def make(node: str, redis_url: str, **extra: object) -> ServerConfig:
        config = shared_config(tmp_path, s3_server, s3_bucket, s3_credentials["region_name"],
                               node, redis_url=redis_url, redis_bytes=64 << 20,
                               redis_preset="loopback")
        return dataclasses.replace(config, **extra)
    return make


@contextlib.asynccontextmanager
async def nodes(make, redis_url: str, names: str = "abc", **options
                ) -> AsyncIterator[list[TierManager]]:
    opened: list[TierManager] = []
    try:
        for name in names:
            opened.append(await open_manager(make(name, redis_url, **options)))
        yield opened
    finally:
        for manager in opened:
            await manager.close()


def assert_same(got, session: dict) -> None:
    assert [bytes(x) for x in got.chunks] == [bytes(d) for _, d in session["chunks"]]
    assert got.manifest.tail == session["tail"]
