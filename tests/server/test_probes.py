"""Health that probes, against real redis-server processes and an idle server (no call
but health checks): ``kvtier_tier_up``, the breaker and gRPC health follow Redis down and
up again within two probe intervals, a Redis Cluster in ``cluster_state:fail`` shows
down, and credentials Redis refuses stop the start with one line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable

from services.cli.health import check
from services.server.server import KVTierServer
from tests.support.servers import RedisServer
from tests.support.service import ROOT, running_server

PROBE_S = 1.0  # generous against the probes' own work on a busy machine
COOLDOWN_S = PROBE_S / 2  # an open breaker half-opens on the next probe after this


async def within(intervals: float, condition: Callable[[], object]) -> bool:
    """Whether ``condition()`` holds at some point within ``intervals`` probe intervals."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + intervals * PROBE_S
    while loop.time() < deadline:
        if await condition():
            return True
        await asyncio.sleep(PROBE_S / 20)
    return bool(await condition())


def _sample(server: KVTierServer, name: str, **labels: str) -> float | None:
    return server.metrics.registry.get_sample_value(name, labels)


async def _state(server: KVTierServer, target: str) -> tuple[float | None, float | None, str]:
    """(tier_up of redis, breaker_open of redis, health) as an operator would read them."""
    return (_sample(server, "kvtier_tier_up", tier="redis"),
            _sample(server, "kvtier_breaker_open", dependency="redis"),
            await check(target, "", 5.0, {}))


def _probed(**extra) -> dict:
    return dict(probe_interval_s=PROBE_S, breaker_cooldown_s=COOLDOWN_S,
                redis_preset="loopback", **extra)


async def test_an_idle_node_follows_redis_down_and_up_within_two_probe_intervals(
        tmp_path, redis_server_factory):
    redis = redis_server_factory()
    async with running_server(tmp_path, redis_url=redis.url, **_probed()) as (server, target):
        assert await _state(server, target) == (1, 0, "SERVING")
        redis.kill()

        async def down() -> bool:
            return await _state(server, target) == (0, 1, "NOT_SERVING")

        assert await within(2, down), await _state(server, target)
        redis.restart()

        async def up() -> bool:
            return await _state(server, target) == (1, 0, "SERVING")

        assert await within(2, up), await _state(server, target)


async def test_health_ignores_a_tier_not_required(tmp_path, redis_server_factory):
    redis = redis_server_factory()
    async with running_server(tmp_path, redis_url=redis.url, required_tiers=[],
                              **_probed()) as (server, target):
        redis.kill()

        async def down() -> bool:
            return (await _state(server, target))[0] == 0

        assert await within(2, down)
        assert await check(target, "", 5.0, {}) == "SERVING"  # Redis is only a cache here


def _cluster_fails(node: RedisServer) -> bool:
    with node.client() as client:
        return client.cluster("info")["cluster_state"] == "fail"


async def test_a_cluster_in_fail_shows_down_on_an_idle_node(tmp_path, redis_cluster_factory):
    cluster = redis_cluster_factory(masters=3, node_timeout_ms=500)
    async with running_server(tmp_path, redis_url=cluster.url,
                              **_probed()) as (server, target):
        assert await _state(server, target) == (1, 0, "SERVING")
        cluster.nodes[2].kill()  # no replica: its slots are lost, the cluster fails
        while not _cluster_fails(cluster.nodes[0]):
            await asyncio.sleep(0.05)  # the cluster's own node timeout, not ours

        async def down() -> bool:
            return (await _state(server, target))[0::2] == (0, "NOT_SERVING")

        assert await within(2, down), await _state(server, target)


def _serve(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "AWS_"))}
    return subprocess.run([sys.executable, "-m", "services.cli", "serve", "--preset", "test",
                           "--listen", "127.0.0.1:0", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if "WARNING" not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_start_fails_fast_on_a_password_redis_refuses(tmp_path, redis_server_factory):
    redis = redis_server_factory()
    with redis.client() as client:
        client.config_set("requirepass", "the-right-one")
    wrong = redis.url.replace("redis://", "redis://:not-it@")
    line = _one_line(_serve("--data-dir", str(tmp_path / "a"), "--redis-url", wrong))
    assert "refuses the credentials" in line and "not-it" not in line
    line = _one_line(_serve("--data-dir", str(tmp_path / "b"), "--redis-url", redis.url))
    assert "refuses the credentials" in line


def test_start_names_a_cluster_url_pointed_at_a_single_redis(tmp_path, redis_server_factory):
    redis = redis_server_factory()
    url = redis.url.replace("redis://", "redis+cluster://").removesuffix("/0")
    line = _one_line(_serve("--data-dir", str(tmp_path), "--redis-url", url))
    assert "redis+cluster://" in line and "not a cluster" in line


async def test_an_idle_fleet_node_follows_its_bucket_down_and_up(
        tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch):
    """The shared metadata lives in the bucket: the object tier's probe covers both."""
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    s3 = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)
    async with running_server(tmp_path, s3_endpoint=s3_server, s3_bucket=s3_bucket,
                              s3_region=s3_credentials["region_name"], metadata="shared",
                              node_id="probed", **_probed()) as (server, target):

        async def object_state() -> tuple[float | None, str]:
            return (_sample(server, "kvtier_tier_up", tier="object"),
                    await check(target, "", 5.0, {}))

        assert await object_state() == (1, "SERVING")
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket):
            for item in page.get("Contents", []):
                s3.delete_object(Bucket=s3_bucket, Key=item["Key"])
        s3.delete_bucket(Bucket=s3_bucket)

        async def down() -> bool:
            return await object_state() == (0, "NOT_SERVING")

        assert await within(2, down), await object_state()
        s3.create_bucket(Bucket=s3_bucket)

        async def up() -> bool:
            return await object_state() == (1, "SERVING")

        assert await within(2, up), await object_state()


def test_start_fails_fast_on_credentials_s3_refuses(tmp_path):
    """An S3 endpoint that answers 403 to the bucket's HEAD: one line naming the refusal
    (moto accepts any key, so a bare HTTP server plays S3 here)."""
    import http.server
    import threading

    from kvstore.format.errors import InvalidRequest
    from services.server.store import check_bucket
    from tests.support.service import config_for

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        config = config_for(tmp_path, s3_bucket="kvtier-refused", s3_region="us-east-1",
                            s3_endpoint=f"http://127.0.0.1:{httpd.server_address[1]}")
        try:
            check_bucket(config)
        except InvalidRequest as exc:
            assert "refuses the credentials (403)" in str(exc)
        else:
            raise AssertionError("a 403 from S3 did not stop the start")
    finally:
        httpd.shutdown()


async def test_an_idle_node_follows_its_replay_workers_down_and_up(tmp_path):
    """With ``replay`` required, health says NOT_SERVING once no remote replay worker
    answers its health check, and SERVING again when one does, with no resume asked."""
    from replay.worker import ReplayWorker
    from services.replay.server import create_server as create_worker_server
    from tests.support.replay import tiny_model

    worker = ReplayWorker(tiny_model(), default_tokens=16)
    worker_server, port = await create_worker_server("127.0.0.1:0", worker)
    try:
        async with running_server(tmp_path, replay="remote",
                                  replay_workers=f"127.0.0.1:{port}",
                                  **_probed(required_tiers=["replay"])
                                  ) as (server, target):

            async def health() -> str:
                return await check(target, "", 5.0, {})

            async def breaker() -> float | None:
                return _sample(server, "kvtier_breaker_open",
                               dependency=f"replay:127.0.0.1:{port}")

            assert await health() == "SERVING" and await breaker() == 0
            await worker_server.stop(0)

            async def down() -> bool:
                return await health() == "NOT_SERVING" and await breaker() == 1

            assert await within(2, down), (await health(), await breaker())
            worker_server, _ = await create_worker_server(f"127.0.0.1:{port}", worker)

            async def up() -> bool:
                return await health() == "SERVING" and await breaker() == 0

            assert await within(2, up), (await health(), await breaker())
    finally:
        await worker_server.stop(0)
        await worker.close()


def test_replay_names_a_dependency_health_may_require():
    from services.server.config_load import load_config

    config = load_config(preset="test", overrides={"required_tiers": ["replay"]})
    assert config.required_tiers == ("replay",)
    try:
        load_config(preset="test", overrides={"required_tiers": ["disk"]})
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        assert "'replay'" in str(exc) and "disk" in str(exc)
    else:
        raise AssertionError("required_tiers accepted a tier that is not remote")
