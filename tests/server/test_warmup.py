"""Start-up of a real loopback server: with ``replay_warmup`` its in-process replay model is
loaded and has run before health checking says SERVING (NOT_SERVING until then); without
it the model stays unloaded until a resume needs it. And the object tier's boto3 pool is
sized to the server's streams."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.server.config_load import load_config
from services.server.limits import s3_pool_connections
from services.server.preflight import check
from services.server.server import create_server
from services.server.store import open_manager
from tests.support.service import config_for, running_server

SERVICES = ("", "kvtier.v1.KVTier")


async def statuses(target: str) -> set[int]:
    async with grpc.aio.insecure_channel(target) as channel:
        check_health = health_pb2_grpc.HealthStub(channel).Check
        return {(await check_health(health_pb2.HealthCheckRequest(service=s))).status
                for s in SERVICES}


async def test_with_warm_up_the_model_is_loaded_before_health_says_serving(tmp_path):
    config = config_for(tmp_path, replay="in-process", replay_warmup=True)
    server, port = await create_server(config, wait_ready=False)
    try:
        backend = server.servicer.replay
        # Hold the warm-up where it loads the model (it has not run yet: create_server
        # returned without waiting), so the probe below is sure to come first.
        await backend._loading.acquire()
        target = f"127.0.0.1:{port}"
        assert await statuses(target) == {health_pb2.HealthCheckResponse.NOT_SERVING}
        assert not backend.loaded
        backend._loading.release()
        await server.ready
        assert backend.loaded  # a first resume finds it loaded
        assert (await backend.worker()).warmed_up  # and has run once
        assert await statuses(target) == {health_pb2.HealthCheckResponse.SERVING}
    finally:
        await server.stop(0.5)


async def test_without_warm_up_the_model_stays_unloaded(tmp_path):
    async with running_server(tmp_path, replay="in-process", replay_warmup=False) as (
            server, target):
        assert await statuses(target) == {health_pb2.HealthCheckResponse.SERVING}
        assert not server.servicer.replay.loaded


def test_warm_up_is_the_default_and_preflight_checks_the_weights_it_loads(tmp_path):
    assert load_config(env={}).replay_warmup
    assert "replay_warmup" in load_config(env={}).summary()
    config = load_config(env={}, overrides={"data_dir": tmp_path, "listen": "127.0.0.1:0",
                                            "replay_weights": str(tmp_path / "none")})
    try:
        check(config)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        assert "replay_weights" in str(exc) and "replay_warmup" in str(exc)
    else:
        raise AssertionError("preflight accepted missing weights the warm-up loads")
    check(config.replace(replay_warmup=False))  # lazy: the first resume reports it


async def test_the_object_tiers_pool_follows_the_servers_streams(
        tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch, managers):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    sizes = []
    for streams in (8, 100):
        config = config_for(tmp_path / str(streams), s3_endpoint=s3_server,
                            s3_bucket=s3_bucket, s3_region=s3_credentials["region_name"],
                            max_streams=streams)
        manager = managers.adopt(await open_manager(config))
        objects = next(t for t in manager.tiers if t.name == "object")
        client, _, _ = objects.s3_location()
        assert client.meta.config.max_pool_connections == s3_pool_connections(config)
        sizes.append(client.meta.config.max_pool_connections)
    assert sizes[1] - sizes[0] == 92  # one more connection per stream
    assert sizes[0] >= 8 + objects.remote.max_threads  # and room for every call's thread
