"""Shared builders for the fleet tests: a node's config over moto's S3 server, and what
the bucket really holds (asked of S3, not of a node)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from kvstore.fleet import GcTiming, prepare_bucket
from kvstore.manifest import MANIFEST_PREFIX, SessionManifest
from services.server.config import ServerConfig
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
