"""The fleet's operator commands against moto's S3 server, on data real stores made:
``kvtier fleet-gc`` (dry run and sweep, from a config file) and ``kvtier migrate`` (a
single-node directory copied to the bucket, conflicts reported and kept, idempotent)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch

from kvstore.format import registry as layouts
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import get_layout
from kvtier import AsyncClient
from services.cli.main import main
from services.server.config import ServerConfig
from services.server.server import create_server
from services.server.store import open_manager
from tests.support.fleet import bucket_chunks, kept_and_dropped, shared_config
from tests.support.manager import make_session, random_tokens
from tests.support.service import streams_for, tokens_for


def forget(spec: LayoutSpec) -> None:
    """Drop a registered layout from this process, as a fresh process starts."""
    layouts._REGISTRY.pop(spec.name, None)


@pytest.fixture
def fleet_toml(tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch):
    """(write(name, node, **keys) -> config path, shared config factory)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    region = s3_credentials["region_name"]

    def write(name: str, node: str, **keys: object) -> str:
        values = dict(data_dir=str(tmp_path / node), metadata="shared", node_id=node,
                      s3_bucket=s3_bucket, s3_endpoint=s3_server, s3_region=region,
                      object_compression_level=-1, host_bytes=8 << 20, disk_bytes=64 << 20,
                      **keys)
        lines = [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        path = tmp_path / f"{name}.toml"
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    return write, lambda node: shared_config(tmp_path, s3_server, s3_bucket, region, node)


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


async def held_chunks(config: ServerConfig) -> set[str]:
    node = await open_manager(config)
    try:
        return await bucket_chunks(node.meta)
    finally:
        await node.close()


def session(i: int, window: bool = False) -> dict:
    return make_session(random_tokens(64, i), seed=i, window=window, tenant="acme")


def test_fleet_gc_sweeps_the_configured_bucket_and_a_dry_run_deletes_nothing(fleet_toml,
                                                                              capsys):
    write, shared = fleet_toml
    kept, dropped = session(1), session(2)

    async def setup() -> None:
        node = await open_manager(shared("a"))
        await kept_and_dropped(node, kept, dropped)

    asyncio.run(setup())
    config = write("gc", "gc", fleet_gc_grace_s=0.0, fleet_retain_s=0.0)
    code, dry = run_json(capsys, "fleet-gc", "--config", config, "--json", "--dry-run")
    assert code == 0 and dry["dry_run"]
    assert dry["candidates"] == len(dropped["chunks"]) and dry["deleted"] == 0
    assert dry["live"] == len(kept["chunks"])
    assert dry["listed"] == dry["live"] + dry["candidates"]
    code, swept = run_json(capsys, "fleet-gc", "--config", config, "--json",
                           "--margin-s", "0.2", "--spill-bound-s", "0.5")
    assert code == 0 and swept["deleted"] == len(dropped["chunks"])
    assert {"listed", "live", "candidates", "deleted", "kept_young", "claimed",
            "seconds"} <= set(swept)
    assert not {key for key, _ in dropped["chunks"]} & asyncio.run(held_chunks(shared("a")))
    # the default grace period keeps the chunks a sweep has not seen written long ago
    async def drop_kept() -> None:
        node = await open_manager(shared("a"))
        try:
            await node.delete("acme", "kept")
        finally:
            await node.close()

    asyncio.run(drop_kept())
    code, young = run_json(capsys, "fleet-gc", "--config", write("gc2", "gc"), "--json",
                           "--dry-run")
    assert code == 0 and young["candidates"] == 0
    assert young["kept_young"] == len(kept["chunks"])


def test_fleet_gc_refuses_a_local_config(tmp_path, capsys):
    path = tmp_path / "local.toml"
    path.write_text(f'data_dir = "{tmp_path}"\n')
    assert main(["fleet-gc", "--config", str(path)]) == 2
    assert "metadata = 'shared'" in capsys.readouterr().err


def test_migrate_copies_a_single_node_directory_once_and_keeps_conflicts(fleet_toml,
                                                                         tmp_path, capsys):
    write, shared = fleet_toml
    sessions = {f"s{i}": session(10 + i, window=True) for i in range(3)}
    local_conflict, bucket_conflict = session(20), session(21)
    single = ServerConfig(data_dir=tmp_path / "single", host_bytes=8 << 20,
                          disk_bytes=64 << 20, object_compression_level=-1)

    async def setup() -> None:
        node = await open_manager(single)  # metadata = "local", objects in data_dir
        try:
            for name, content in sessions.items():
                await node.spill("acme", name, generation=1, ack="durable", **content)
            await node.spill("acme", "c", generation=1, ack="durable", **local_conflict)
        finally:
            await node.close()
        other = await open_manager(shared("b"))  # already serving "acme/c" in the bucket
        try:
            await other.spill("acme", "c", generation=4, ack="durable", **bucket_conflict)
        finally:
            await other.close()

    asyncio.run(setup())
    config = write("migrate", "single")  # the node's config as it will serve
    code, first = run_json(capsys, "migrate", "--config", config, "--json")
    assert code == 1 and first["conflicts"] == ["acme/c"]
    assert first["sessions"] == 4 and first["migrated"] == 3 and not first["incomplete"]
    total = sum(len(content["chunks"]) for content in sessions.values())
    # the conflict's own chunks are not uploaded: nothing would name them
    assert first["chunks_uploaded"] + first["chunks_present"] == total
    assert first["chunks_uploaded"] >= total
    code, again = run_json(capsys, "migrate", "--config", config, "--json")
    assert code == 1 and again["migrated"] == 0 and again["already"] == 3
    assert again["chunks_uploaded"] == 0 and again["conflicts"] == ["acme/c"]

    async def check() -> None:
        for node_name in ("fresh", "single"):  # another node, and the migrated one
            node = await open_manager(shared(node_name))
            try:
                held = await bucket_chunks(node.meta)
                for name, content in sessions.items():
                    assert {key for key, _ in content["chunks"]} <= held
                    got = await node.restore("acme", name)
                    assert got.manifest.generation == 1 and got.replay_needed
                    assert [bytes(x) for x in got.chunks] == \
                        [bytes(d) for _, d in content["chunks"]]
                    assert got.manifest.tail == content["tail"]
                kept = await node.restore("acme", "c")  # the bucket's, not overwritten
                assert kept.manifest.generation == 4
                assert [bytes(x) for x in kept.chunks] == \
                    [bytes(d) for _, d in bucket_conflict["chunks"]]
            finally:
                await node.close()

    asyncio.run(check())


def test_migrate_refuses_a_directory_without_a_disk_tier(fleet_toml, tmp_path, capsys):
    write, _ = fleet_toml
    assert main(["migrate", "--config", write("m", "empty"),
                 "--data-dir", str(tmp_path / "nothing")]) == 2
    assert "no disk tier" in capsys.readouterr().err


def test_migrate_carries_the_directorys_registered_layouts_into_the_fleet(fleet_toml,
                                                                          tmp_path, capsys):
    write, shared = fleet_toml
    spec = dataclasses.replace(get_layout("kvtier-bundled"), name="migrated-copy")
    single = ServerConfig(data_dir=tmp_path / "single", host_bytes=8 << 20,
                          disk_bytes=64 << 20, object_compression_level=-1, listen="127.0.0.1:0")
    tokens = tokens_for(700, seed=3)
    persistent = streams_for(spec, 700, seed=3)

    async def setup() -> None:
        server, port = await create_server(single)
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as kv:
                await kv.register_layout(spec)
                await kv.spill("acme", "copy", spec, tokens, persistent, generation=1,
                               ack="durable")
        finally:
            await server.stop(0.5)
            forget(spec)  # a fresh process knows only what its directory or bucket holds

    asyncio.run(setup())
    code, report = run_json(capsys, "migrate", "--config", write("migrate", "single"), "--json")
    assert code == 0 and report["migrated"] == 1, report
    forget(spec)

    async def resume_elsewhere() -> None:
        server, port = await create_server(shared("fresh").replace(listen="127.0.0.1:0"))
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as kv:
                got = await kv.restore("acme", "copy", want_window=False)
                assert got.layout.layout_id == spec.layout_id
                for name, data in persistent.items():
                    assert torch.equal(got.persistent[name].codes, data.codes), name
        finally:
            await server.stop(0.5)

    asyncio.run(resume_elsewhere())
