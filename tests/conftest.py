"""Fixtures shared by every test: real redis-server processes, a real three-master Redis
Cluster, and moto's S3 server over HTTP, all on loopback ports; and the addresses of a hung
server and of one that is down, for the engine integrations.

``async def`` tests run on a fresh event loop each (see ``pytest_pyfunc_call``); fixtures
stay synchronous, so an async test builds its own clients from the URLs fixtures give.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from tests.support.closing import Opened
from tests.support.manager import Managers
from tests.support.servers import (
    MotoServer,
    RedisClusterProcesses,
    RedisServer,
    down_address,
    hung_address,
    start_redis_cluster,
)

# Without a GPU triton runs only interpreted. The kernel tests switch the process to the
# interpreter at collection, which fails once anything (transformers, when a test module
# imports it) has imported triton compiled: so the mode is set before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the fleet tests' fixtures: a model's saved weights and the config every node shares
pytest_plugins = ["tests.support.fleet"]


@pytest.fixture(scope="session", autouse=True)
def default_port_taken():
    """Holds 127.0.0.1:50051 (the default listen and server address) for the whole run, as
    another process on a developer's or CI's machine may: a test that leans on the default
    port fails everywhere, not only on a busy machine. Bound, never listening, so a client
    that dials it is refused at once. Under pytest-xdist one worker holds it."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with contextlib.suppress(OSError):  # another worker, or another process, holds it
        held.bind(("127.0.0.1", 50051))
    yield
    held.close()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run coroutine test functions with ``asyncio.run`` (no plugin needed)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    # every fixture's value, the test's own and those its fixtures asked for
    held = [value for value in pyfuncitem.funcargs.values() if isinstance(value, Opened)]
    asyncio.run(_closing(pyfuncitem.obj, {name: pyfuncitem.funcargs[name] for name in names},
                         held))
    return True


async def _closing(test, kwargs: dict, held: list[Opened]) -> None:
    """Run the test, then close what it or its fixtures left open (``managers``,
    ``opened``), in its loop."""
    try:
        await test(**kwargs)
    finally:
        for value in held:
            await value.close_all()


@pytest.fixture
def managers() -> Managers:
    """``await managers.open(tiers, meta, **options) -> TierManager`` (or
    ``managers.adopt(await open_manager(config))``): closed when an ``async def`` test
    ends, passed or failed (``Managers``)."""
    return Managers()


@pytest.fixture
def opened() -> Opened:
    """``opened.adopt(tier) -> tier``: closed when an ``async def`` test ends, passed or
    failed, unless the test closed it first (``await opened.close(tier)``)."""
    return Opened()


# -- Redis, single node --


@pytest.fixture(scope="session")
def redis_process(tmp_path_factory: pytest.TempPathFactory):
    """The session's shared ``RedisServer`` (no persistence). A test may ``kill()`` and
    ``restart()`` it mid-test; ``redis_server`` brings it back for the next test."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(redis_process: RedisServer) -> str:
    """URL (``redis://127.0.0.1:PORT/0``) of the shared redis-server, running and empty."""
    if not redis_process.running:
        redis_process.restart()
    redis_process.flushall()
    return redis_process.url


@pytest.fixture
def redis_server_factory(tmp_path_factory: pytest.TempPathFactory):
    """``redis_server_factory(persistent=False) -> RedisServer``: private servers, started
    now and stopped when the test ends."""
    started: list[RedisServer] = []

    def start(*, persistent: bool = False) -> RedisServer:
        server = RedisServer(tmp_path_factory.mktemp("redis"), persistent=persistent)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# -- Redis Cluster --


@pytest.fixture(scope="session")
def redis_cluster_process(tmp_path_factory: pytest.TempPathFactory):
    """A three-master Redis Cluster (no replicas) shared by the session;
    ``.nodes`` are its ``RedisServer`` processes."""
    cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"), masters=3)
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_factory(tmp_path_factory: pytest.TempPathFactory):
    """``redis_cluster_factory(masters=3, node_timeout_ms=2000) -> RedisClusterProcesses``:
    a private cluster (for tests that kill nodes), stopped when the test ends."""
    started: list[RedisClusterProcesses] = []

    def start(*, masters: int = 3, node_timeout_ms: int = 2000) -> RedisClusterProcesses:
        cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"),
                                      masters=masters, node_timeout_ms=node_timeout_ms)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.stop()


@pytest.fixture
def redis_cluster(redis_cluster_process: RedisClusterProcesses) -> str:
    """URL (``redis+cluster://127.0.0.1:PORT``) of the shared cluster, every master empty."""
    redis_cluster_process.flushall()
    return redis_cluster_process.url


# -- S3 (moto) --


@pytest.fixture(scope="session")
def s3_server():
    """Endpoint URL of moto's S3 server (in-process, server mode, real HTTP). Any access
    key works (see ``s3_credentials``); tests create their own buckets (``s3_bucket``)."""
    server = MotoServer()
    server.start()
    yield server.endpoint_url
    server.stop()


@pytest.fixture
def s3_credentials() -> dict[str, str]:
    """``aws_access_key_id``, ``aws_secret_access_key`` and ``region_name`` for moto."""
    return dict(MotoServer.CREDENTIALS)


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A fresh, empty bucket on the moto server; its name."""
    import boto3

    name = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_server, **MotoServer.CREDENTIALS)
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def hung_server():
    """The address of a server that takes connections and never answers."""
    with hung_address() as address:
        yield address


@pytest.fixture
def down_server() -> str:
    """The address of a server that refuses connections."""
    return down_address()


# -- a real small medium --


@pytest.fixture
def tmpfs_factory(tmp_path):
    """``mount(size_mib) -> Path``: a fresh tmpfs of that size under ``tmp_path`` (a medium
    that fills before a tier's own capacity); unmounted after the test. Skips where
    mounting is not allowed (root and CAP_SYS_ADMIN needed)."""
    mounts: list[Path] = []

    def mount(size_mib: int) -> Path:
        path = tmp_path / f"tmpfs{len(mounts)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs",
                               str(path)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here (root and CAP_SYS_ADMIN needed): "
                        f"{done.stderr.strip() or done.returncode}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)
