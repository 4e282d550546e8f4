"""Fixtures shared by every test: real redis-server processes, a real three-master Redis
Cluster, and moto's S3 server over HTTP, all on loopback ports.

``async def`` tests run on a fresh event loop each (see ``pytest_pyfunc_call``); fixtures
stay synchronous, so an async test builds its own clients from the URLs fixtures give.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch

# Without a GPU triton runs only interpreted. The kernel tests switch the process to the
# interpreter at collection, which fails once anything (transformers, when a test module
# imports it) has imported triton compiled: so the mode is set before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

LOOPBACK = "127.0.0.1"
# the fleet tests' fixtures: a model's saved weights and the config every node shares
pytest_plugins = ["fleet_support"]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run coroutine test functions with ``asyncio.run`` (no plugin needed)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    asyncio.run(pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in names}))
    return True


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback port free right now (and port + 10000 too, for a cluster node's bus).

    Random, not the kernel's next ephemeral port, so helpers running tests at the same
    time rarely pick the same one; ``RedisServer.start`` retries on a clash anyway."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _port_is_free(port) and (not with_cluster_bus or _port_is_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


class RedisServer:
    """One real ``redis-server`` process on a loopback port, in its own directory."""

    def __init__(self, workdir: Path, *, persistent: bool = False, cluster: bool = False,
                 cluster_node_timeout_ms: int = 2000) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not on PATH (Debian: apt-get install redis-server)")
        self.workdir = workdir
        self.persistent = persistent
        self.cluster = cluster
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self) -> redis.Redis:
        """A synchronous client for test set-up and inspection."""
        return redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=5)

    def start(self) -> None:
        for _ in range(5):
            self.port = free_port(with_cluster_bus=self.cluster)
            if self._launch():
                return
        raise RuntimeError(f"redis-server did not start; see {self.workdir}/redis.log")

    def restart(self) -> None:
        """Start again on the same port (after ``kill``), as an operator's restart would."""
        if self.running:
            raise RuntimeError("redis-server is still running")
        if not self._launch():
            raise RuntimeError(f"redis-server did not restart; see {self.workdir}/redis.log")

    def _launch(self) -> bool:
        args = ["redis-server", "--port", str(self.port), "--bind", LOOPBACK,
                "--dir", str(self.workdir), "--logfile", "redis.log",
                "--protected-mode", "no", "--daemonize", "no"]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        else:
            args += ["--appendonly", "no", "--save", ""]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", str(self.cluster_node_timeout_ms)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False  # port clash or bad config: the log says which
            try:
                with self.client() as client:
                    if client.ping():
                        return True
            except (redis.ConnectionError, redis.BusyLoadingError):
                time.sleep(0.02)
        self.kill()
        return False

    def kill(self) -> None:
        """SIGKILL: an abrupt outage, no shutdown save."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        self.kill()
        self.process = None

    def flushall(self) -> None:
        with self.client() as client:
            client.flushall()


class RedisClusterProcesses:
    """Several cluster-enabled redis-server processes joined into one cluster."""

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes

    @property
    def url(self) -> str:
        return f"redis+cluster://{LOOPBACK}:{self.nodes[0].port}"

    def flushall(self) -> None:
        for node in self.nodes:
            node.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_redis_cluster(workdir: Path, *, masters: int = 3, node_timeout_ms: int = 2000
                        ) -> RedisClusterProcesses:
    """``node_timeout_ms``: how long a silent master stays "possibly failing" before the
    cluster marks it failed and (with no replica to promote) stops serving every slot."""
    nodes = []
    for index in range(masters):
        node_dir = workdir / f"node{index}"
        node_dir.mkdir()
        node = RedisServer(node_dir, cluster=True, cluster_node_timeout_ms=node_timeout_ms)
        node.start()
        nodes.append(node)
    cluster = RedisClusterProcesses(nodes)
    try:
        subprocess.run(
            ["redis-cli", "--cluster", "create",
             *[f"{LOOPBACK}:{node.port}" for node in nodes],
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all(_cluster_ok(node) for node in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _cluster_ok(node: RedisServer) -> bool:
    with node.client() as client:
        return client.cluster("info")["cluster_state"] == "ok"


class MotoServer:
    """moto's S3 server in this process (a thread), in server mode, over real HTTP."""

    CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                   "region_name": "us-east-1"}

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request
        self.endpoint_url = ""

    def start(self) -> None:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.stop()


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
