"""Real servers for tests, each on a loopback port: ``redis-server`` processes, a Redis
Cluster of them, and moto's S3 server over HTTP. The conftest's fixtures start them. And
the two servers an engine integration must survive: a hung one and one that is down."""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

LOOPBACK = "127.0.0.1"


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


@contextlib.contextmanager
def hung_address() -> Iterator[str]:
    """The address of a loopback port that takes connections and never answers: the
    kernel completes the TCP handshake, nothing accepts or reads, so every call hangs until
    its deadline."""
    with socket.socket() as listener:
        listener.bind((LOOPBACK, 0))
        listener.listen(16)
        yield f"{LOOPBACK}:{listener.getsockname()[1]}"


def down_address() -> str:
    """The address of a loopback port nothing listens on: connections are refused."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return f"{LOOPBACK}:{sock.getsockname()[1]}"


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
