"""Shared builders for the fleet tests: a node's config over moto's S3 server, what the
bucket really holds (asked of S3, not of a node), and real servers of a fleet over one
model's saved weights (the ``model_state`` and ``fleet_env`` fixtures: import them)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch

from kvstore.fleet.gc import GcTiming, prepare_bucket
from kvstore.format.registry import get_layout
from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest
from kvtier.codec import decode_window
from model.checkpoint import load, save
from model.config import BUNDLED
from model.infer import prefill
from model.net import KVTierLM
from replay.state_codec import state_to_chunks
from services.server.config import ServerConfig
from services.server.config_load import load_config
from services.server.server import create_server
from services.server.store import open_manager

# Sweeps for tests: every unnamed chunk is collectable at once (no grace, no retention),
# and the mark wait is short. A spill bound of half a second is far above what a spill's
# commit takes on loopback; the margin covers a manifest PUT's time in flight there.
FAST = GcTiming(grace_s=0.0, retain_s=0.0, spill_bound_s=0.5, request_margin_s=0.25,
                lease_s=30.0)


def shared_config(data_dir: Path, endpoint: str, bucket: str, region: str, node: str,
                  **extra: object) -> ServerConfig:
    return ServerConfig(data_dir=data_dir / node, host_bytes=8 << 20, disk_bytes=64 << 20,
                        object_bytes=1 << 30, s3_endpoint=endpoint, s3_bucket=bucket,
                        s3_region=region, object_compression_level=-1, metadata="shared",
                        node_id=node, **extra)


async def kept_and_dropped(node, kept: dict, dropped: dict) -> None:
    """On ``node`` (closed after): the bucket prepared for ``FAST`` sweeps, sessions
    acme/kept and acme/dropped spilled durable, and acme/dropped deleted."""
    try:
        await prepare_bucket(node.meta, FAST.spill_bound_s)
        await node.spill("acme", "kept", generation=1, ack="durable", **kept)
        await node.spill("acme", "dropped", generation=1, ack="durable", **dropped)
        await node.delete("acme", "dropped")
    finally:
        await node.close()


async def bucket_chunks(meta) -> set[str]:
    """Chunk keys the bucket holds now (one listing)."""
    prefix = meta.tier.s3_location()[2]
    return {item["Key"][len(prefix):-4] for item in await meta.io.listing(prefix)
            if item["Key"].endswith((".bin", ".zst"))
            and not item["Key"].startswith(meta.paths.root)}


async def named_chunks(meta) -> dict[str, set[str]]:
    """manifest key -> the chunks it names, for every manifest in the bucket."""
    return {key: set(SessionManifest.decode(value).chunk_keys)
            for key, value in await meta.scan(MANIFEST_PREFIX)}


@contextlib.asynccontextmanager
async def fleet_nodes(make_config: Callable[..., ServerConfig]) -> AsyncIterator[Callable]:
    """``open_node(name, **config) -> TierManager`` over ``make_config``'s bucket, each
    closed at the end; the first one prepares the bucket for ``FAST`` sweeps."""
    managers = []

    async def open_node(node: str, **extra: object):
        manager = await open_manager(make_config(node, **extra))
        if not managers:  # before any spill: the tests' short spill bound
            await prepare_bucket(manager.meta, FAST.spill_bound_s)
        managers.append(manager)
        return manager

    try:
        yield open_node
    finally:
        for manager in managers:
            await manager.close()


@contextlib.asynccontextmanager
async def fleet_servers(make_config: Callable[[str], ServerConfig], names: str
                        ) -> AsyncIterator[dict[str, str]]:
    """A real server per name on a free loopback port (``make_config(name)``, listening
    on port 0); yields name -> address, every server stopped at the end."""
    servers = []
    addresses: dict[str, str] = {}
    try:
        for name in names:
            server, port = await create_server(make_config(name))
            servers.append(server)
            addresses[name] = f"127.0.0.1:{port}"
        yield addresses
    finally:
        for server in servers:
            await server.stop(0.5)


SPEC = get_layout("kvtier-bundled")
TOKENS = 1100  # two whole chunks (512 tokens each) and a tail; the window is 128


@pytest.fixture(scope="module")
def model_state(tmp_path_factory):
    """Saved random weights, token ids and the prefilled state as (chunks, tail, window)
    of SPEC, from exactly the weights the servers load (fp16), so a replay is exact."""
    torch.manual_seed(0)
    weights = tmp_path_factory.mktemp("weights") / "model.safetensors"
    save(KVTierLM(BUNDLED).eval(), weights)
    ids = torch.randint(0, BUNDLED.vocab, (TOKENS,), generator=torch.Generator().manual_seed(1))
    state, _ = prefill(load(weights), ids, logits="none")
    chunks, tail, window = state_to_chunks(SPEC, state)
    return weights, ids, [c for _, c in chunks], tail, window


@pytest.fixture
def node_config(tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch):
    """``make(node, **extra) -> ServerConfig``: a shared-metadata node over the test's
    bucket (``shared_config``), with the S3 credentials in this process's environment
    (a module may define its own ``node_config``, which wins)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    return lambda node, **extra: shared_config(tmp_path, s3_server, s3_bucket,
                                               s3_credentials["region_name"], node, **extra)


@pytest.fixture
def fleet_env(s3_server, s3_bucket, s3_credentials, monkeypatch, model_state):
    """The config every node shares, as ``KVTIER_*`` values (also what a child server
    reads), with the S3 credentials in this process's environment."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    return {"s3_endpoint": s3_server, "s3_bucket": s3_bucket, "metadata": "shared",
            "s3_region": s3_credentials["region_name"], "replay": "in-process",
            "replay_weights": str(model_state[0]), "host_bytes": "16MiB"}


def fleet(tmp_path: Path, shared: dict, redis_url: str, names: str = "abc"):
    """One real server per name (its node_id), each over its own data directory; yields
    name -> address."""
    return fleet_servers(lambda name: load_config(preset="test", env={}, overrides={
        **shared, "redis_url": redis_url, "node_id": name, "data_dir": tmp_path / name,
        "listen": "127.0.0.1:0"}), names)


def assert_same_window(got: bytes, want: bytes, tokens) -> None:
    mine, start = decode_window(SPEC, tokens, got)
    theirs, want_start = decode_window(SPEC, tokens, want)
    assert start == want_start and set(mine) == set(theirs)
    for name, data in theirs.items():
        assert torch.equal(mine[name].codes, data.codes), name
        if data.scales is not None:
            assert torch.equal(mine[name].scales, data.scales), name


def assert_persistent(got, chunks: list[bytes], tail: bytes) -> None:
    assert [bytes(c) for c in got.chunks] == [bytes(c) for c in chunks]
    assert bytes(got.tail) == bytes(tail)
