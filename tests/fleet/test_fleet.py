"""A fleet sharing one bucket (docs/fleet.md): any node resumes any session, and
generations are compare-and-swap across nodes (the fleet's sweep: fleet/test_gc.py).
Real servers' stores (``open_manager``) over moto's S3 server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from kvstore.format.errors import (
    GenerationConflict,
    InvalidRequest,
    StaleGeneration,
    TierUnavailable,
)
from kvstore.session.manifest import SessionManifest
from kvstore.tiers.object import ObjectTier
from services.server.config import ServerConfig
from services.server.store import open_manager
from tests.support.manager import make_session, random_tokens
from tests.support.servers import MotoServer


@pytest.fixture
def node_config(tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])

    def make(node: str, endpoint: str = s3_server, bucket: str = s3_bucket) -> ServerConfig:
        return ServerConfig(data_dir=tmp_path / node, host_bytes=8 << 20, disk_bytes=64 << 20,
                            object_bytes=1 << 30, s3_endpoint=endpoint, s3_bucket=bucket,
                            s3_region=s3_credentials["region_name"],
                            object_compression_level=-1, metadata="shared", node_id=node)
    return make


def objects_of(manager) -> ObjectTier:
    return next(tier for tier in manager.tiers if isinstance(tier, ObjectTier))


async def test_any_node_resumes_a_durable_session(node_config, managers):
    a, b, c = [managers.adopt(await open_manager(node_config(n))) for n in "abc"]
    try:
        session = make_session(random_tokens(70, 1), seed=1, tenant="acme")
        await a.spill("acme", "s1", generation=1, ack="durable", **session)
        for other in (b, c):
            got = await other.restore("acme", "s1")
            assert [bytes(x) for x in got.chunks] == [bytes(d) for _, d in session["chunks"]]
            assert got.manifest.tail == session["tail"]
            assert list(got.manifest.token_ids) == list(session["token_ids"])
            assert got.manifest.node_id == "a"
            assert got.window is None and got.replay_needed  # a's window stays on a
        home = await a.restore("acme", "s1")
        assert bytes(home.window) == session["window"] and not home.replay_needed
        assert home.window_tier == "host"
    finally:
        for manager in (a, b, c):
            await managers.close(manager)


async def test_two_nodes_race_each_generation_and_exactly_one_wins(node_config, managers):
    a, b, reader = [managers.adopt(await open_manager(node_config(n)))
                    for n in ("a", "b", "reader")]
    try:
        await a.spill("acme", "s1", generation=1, ack="durable",
                      **make_session(random_tokens(40, 0), seed=0, window=False, tenant="acme"))
        for generation in range(2, 12):
            sessions = [make_session(random_tokens(40 + generation, seed), seed=seed,
                                     tenant="acme",
                                     window=False) for seed in (generation, 100 + generation)]
            for node in (a, b):  # both read the current generation first
                await node.get_manifest("acme", "s1")
            outcomes = await asyncio.gather(*(
                node.spill("acme", "s1", generation=generation, ack="durable", **session)
                for node, session in zip((a, b), sessions, strict=True)),
                return_exceptions=True)
            won = [i for i, o in enumerate(outcomes) if isinstance(o, SessionManifest)]
            lost = [o for o in outcomes if not isinstance(o, SessionManifest)]
            assert len(won) == 1, outcomes
            assert all(isinstance(o, (StaleGeneration, GenerationConflict)) for o in lost)
            stored = await reader.restore("acme", "s1")  # never torn, never mixed
            winner = sessions[won[0]]
            assert stored.manifest.generation == generation
            assert list(stored.manifest.token_ids) == list(winner["token_ids"])
            assert [bytes(x) for x in stored.chunks] == [bytes(d) for _, d in winner["chunks"]]
    finally:
        for manager in (a, b, reader):
            await managers.close(manager)


async def test_an_unreachable_store_refuses_durable_spills_and_hot_sessions_resume(
        node_config, s3_credentials):
    import boto3

    private = MotoServer()
    private.start()
    boto3.client("s3", endpoint_url=private.endpoint_url,
                 **s3_credentials).create_bucket(Bucket="fleet-outage")
    a = await open_manager(node_config("a", private.endpoint_url, "fleet-outage"))
    try:
        session = make_session(random_tokens(50, 3), seed=3, tenant="acme")
        await a.spill("acme", "hot", generation=1, ack="durable", **session)
        private.stop()
        got = await a.restore("acme", "hot")
        assert [bytes(x) for x in got.chunks] == [bytes(d) for _, d in session["chunks"]]
        with pytest.raises(TierUnavailable):
            await a.spill("acme", "new", generation=1, ack="durable",
                          **make_session(random_tokens(50, 4), seed=4, tenant="acme"))
    finally:
        with contextlib.suppress(Exception):
            await a.close()


async def test_shared_metadata_needs_an_s3_object_tier(tmp_path):
    with pytest.raises(InvalidRequest, match="needs an S3 object tier"):
        await open_manager(ServerConfig(data_dir=tmp_path, metadata="shared"))
    with pytest.raises(InvalidRequest, match="metadata must be"):
        ServerConfig(metadata="everywhere")


async def test_a_fleet_node_listening_on_port_0_must_be_named(node_config):
    # every such node would otherwise be "host:0", and take the others' windows for its own
    unnamed = dataclasses.replace(node_config("a"), node_id="", listen="127.0.0.1:0")
    with pytest.raises(InvalidRequest, match="needs node_id"):
        await open_manager(unnamed)
