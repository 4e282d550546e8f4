"""The offline tools against a fleet's bucket on moto's S3 server: ``kvtier migrate``
uploads only what the sessions it migrates need when it meets conflicts (every object
in the bucket counted before and after), migrates an encrypted single-node directory
into a sealed bucket with its key (refused before anything changes otherwise),
``kvtier fleet-gc`` sweeps a sealed bucket with the fleet's key only, and
``kvtier compact`` refuses a fleet node's config rather than collect the bucket's
chunks by one node's reference counts."""

from __future__ import annotations

import asyncio
import base64
import json

import boto3
import pytest

from kvstore.encryption.seal import MAGIC
from services.cli.main import main
from services.server.config import ServerConfig
from services.server.store import open_manager
from tests.support.fleet import bucket_chunks, kept_and_dropped, shared_config
from tests.support.manager import make_session, random_tokens

KEY = base64.b64encode(bytes(range(90, 122))).decode()
WRONG = base64.b64encode(bytes(range(3, 35))).decode()


@pytest.fixture
def fleet(tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch):
    """(write(node) -> the node's TOML config as it will serve, shared config factory,
    every object key in the bucket now)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    monkeypatch.delenv("KVTIER_ENCRYPTION_KEY", raising=False)
    region = s3_credentials["region_name"]
    client = boto3.client("s3", endpoint_url=s3_server, **s3_credentials)

    def write(node: str, **extra: object) -> str:
        values = dict(data_dir=str(tmp_path / node), metadata="shared", node_id=node,
                      s3_bucket=s3_bucket, s3_endpoint=s3_server, s3_region=region,
                      object_compression_level=-1, host_bytes=8 << 20, disk_bytes=64 << 20,
                      **extra)
        path = tmp_path / f"{node}.toml"
        path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
        return str(path)

    def objects() -> set[str]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
        return {item["Key"] for page in pages for item in page.get("Contents", [])}

    def stored_objects() -> dict[str, bytes]:
        return {name: client.get_object(Bucket=s3_bucket, Key=name)["Body"].read()
                for name in objects()}

    objects.stored = stored_objects
    return write, lambda node, **extra: shared_config(tmp_path, s3_server, s3_bucket,
                                                      region, node, **extra), objects


def session(i: int) -> dict:
    return make_session(random_tokens(64, i), seed=i, window=False, tenant="acme")


def single_node(tmp_path, name: str, key: str = "") -> ServerConfig:
    return ServerConfig(data_dir=tmp_path / name, host_bytes=8 << 20, disk_bytes=64 << 20,
                        object_compression_level=-1, encryption_key=key)


async def spill(config: ServerConfig, sessions: dict[str, dict], generation: int = 1
                ) -> None:
    node = await open_manager(config)
    try:
        for name, content in sessions.items():
            await node.spill("acme", name, generation=generation, ack="durable", **content)
    finally:
        await node.close()


def migrate(capsys, config: str, *extra: str) -> tuple[int, dict, str]:
    code = main(["migrate", "--config", config, "--json", *extra])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else {}, err


async def check_restores(config: ServerConfig, sessions: dict[str, dict]) -> set[str]:
    """Every session restores bit-exact from a fleet node; the chunks the bucket holds."""
    node = await open_manager(config)
    try:
        for name, content in sessions.items():
            got = await node.restore("acme", name)
            assert got.manifest.generation == 1
            assert [bytes(x) for x in got.chunks] == [bytes(d) for _, d in content["chunks"]]
            assert got.manifest.tail == content["tail"]
        return await bucket_chunks(node.meta)
    finally:
        await node.close()


def test_a_run_with_conflicts_uploads_no_orphan_chunk(fleet, tmp_path, capsys):
    write, shared, objects = fleet
    clean = {"s0": session(1), "s1": session(2)}
    local = {"c0": session(3), "c1": session(4)}  # the bucket has other c0, c1
    theirs = {"c0": session(5), "c1": session(6)}
    asyncio.run(spill(single_node(tmp_path, "single"), {**clean, **local}))
    asyncio.run(spill(shared("other"), theirs, generation=4))
    before = objects()
    config = write("single")
    code, report, err = migrate(capsys, config)
    assert code == 1, err
    assert sorted(report["conflicts"]) == ["acme/c0", "acme/c1"] and report["migrated"] == 2
    added = objects() - before
    wanted = {key for content in clean.values() for key, _ in content["chunks"]}
    assert report["chunks_uploaded"] == len(wanted) and report["chunks_present"] == 0
    # exactly the clean sessions' chunks and manifests (and the bucket's first epoch)
    assert {name for name in added if name.endswith(".bin")} == {
        f"kvtier/{key}.bin" for key in wanted}
    assert {name for name in added if not name.endswith(".bin")} - {
        "kvtier/fleet/gc/epoch"} == {f"kvtier/fleet/manifest/acme/{s}.kvsm" for s in clean}
    orphans = {key for content in local.values() for key, _ in content["chunks"]}
    assert not any(key in name for key in orphans for name in objects())
    held = asyncio.run(check_restores(shared("fresh"), clean))
    assert wanted <= held and not orphans & held
    after = objects()
    code, again, _ = migrate(capsys, config)  # a rerun: the same plan, nothing new
    assert code == 1 and again["already"] == 2 and again["chunks_uploaded"] == 0
    assert objects() == after


def sealed_objects(objects: dict[str, bytes]) -> bool:
    """Whether every chunk and manifest object is sealed (no token id or KV in clear)."""
    kept = {k: v for k, v in objects.items() if k.endswith((".bin", ".zst", ".kvsm"))}
    return bool(kept) and all(value.startswith(MAGIC) for value in kept.values())


def test_an_encrypted_directory_migrates_sealed_with_its_key_only(fleet, tmp_path, capsys,
                                                                  monkeypatch):
    write, shared, objects = fleet
    sessions = {f"s{i}": session(10 + i) for i in range(3)}
    asyncio.run(spill(single_node(tmp_path, "single", KEY), sessions))
    directory = tmp_path / "single"

    def files() -> dict[str, bytes]:
        return {str(p): p.read_bytes() for p in sorted(directory.rglob("*"))
                if p.is_file() and p.suffix != ".lock"}

    before, bucket = files(), objects()
    config = write("single")
    code, _, err = migrate(capsys, config)  # no key: nothing can be read, nothing changes
    assert code == 2 and "encrypted at rest" in err and "KVTIER_ENCRYPTION_KEY" in err, err
    monkeypatch.setenv("KVTIER_ENCRYPTION_KEY", WRONG)  # the id the server used, not its key
    code, _, err = migrate(capsys, config)
    assert code == 2 and "does not open" in err, err
    assert files() == before and objects() == bucket

    monkeypatch.setenv("KVTIER_ENCRYPTION_KEY", KEY)  # the fleet's key is the node's
    code, report, err = migrate(capsys, config)
    assert code == 0 and report["migrated"] == 3, err
    assert sealed_objects(objects.stored())
    asyncio.run(check_restores(shared("fresh", encryption_key=KEY), sessions))
    code, again, _ = migrate(capsys, config)
    assert code == 0 and again["already"] == 3 and again["chunks_uploaded"] == 0
    monkeypatch.delenv("KVTIER_ENCRYPTION_KEY")  # a clear directory into this sealed bucket
    asyncio.run(spill(single_node(tmp_path, "clear"), {"c0": session(20)}))
    code, _, err = migrate(capsys, write("clear"))
    assert code == 2 and "encrypted at rest" in err, err


def test_fleet_gc_sweeps_a_sealed_bucket_with_the_key_and_refuses_without(
        fleet, tmp_path, capsys, monkeypatch):
    write, shared, objects = fleet
    kept, dropped = session(40), session(41)

    async def setup() -> None:
        node = await open_manager(shared("a", encryption_key=KEY))
        await kept_and_dropped(node, kept, dropped)

    asyncio.run(setup())
    config = write("gc", fleet_gc_grace_s=0.0, fleet_retain_s=0.0)
    sweep = ["fleet-gc", "--config", config, "--json", "--margin-s", "0.2",
             "--spill-bound-s", "0.5"]
    bucket = objects()
    for key in (None, WRONG):
        if key is not None:
            monkeypatch.setenv("KVTIER_ENCRYPTION_KEY", key)
        code = main(sweep)
        err = capsys.readouterr().err
        assert code == 2 and ("encrypted at rest" in err if key is None
                              else "does not open" in err), err
    assert objects() == bucket
    monkeypatch.setenv("KVTIER_ENCRYPTION_KEY", KEY)
    code = main(sweep)
    swept = json.loads(capsys.readouterr().out)
    assert code == 0 and swept["corrupt_manifests"] == 0
    assert swept["deleted"] == len(dropped["chunks"]) and swept["live"] == len(kept["chunks"])
    asyncio.run(check_restores(shared("fresh", encryption_key=KEY), {"kept": kept}))


def test_compact_refuses_a_fleet_config_and_leaves_the_bucket_alone(fleet, tmp_path, capsys):
    write, shared, objects = fleet
    sessions = {"s0": session(30), "s1": session(31)}
    asyncio.run(spill(shared("other"), sessions))  # the fleet's: in the bucket
    config = write("node", retain_unreferenced=False)  # nothing kept as cache
    asyncio.run(spill(shared("node"), {"n0": session(32)}))  # and this node's own disk
    bucket = objects()
    code = main(["compact", "--config", config, "--data-dir", str(tmp_path / "node"),
                 "--json", "--ttl", "0s"])
    err = capsys.readouterr().err
    assert code == 2 and "fleet-gc" in err, err
    assert objects() == bucket
    asyncio.run(check_restores(shared("fresh"), sessions))


async def reference_counts(data_dir) -> dict[str, bytes]:
    from kvstore.tiers.base import REF_PREFIX
    from kvstore.tiers.disk import DiskTier

    disk = DiskTier(data_dir / "disk", 64 << 20, writer=False)
    try:
        return dict(await disk.meta.scan(REF_PREFIX))
    finally:
        await disk.close()


def test_repair_of_a_fleet_node_counts_references_from_the_bucket(fleet, tmp_path, capsys):
    write, shared, objects = fleet
    sessions = {"s0": session(40), "s1": session(41)}
    config = write("node")
    asyncio.run(spill(shared("node"), sessions))  # its manifests go to the bucket alone
    counted = asyncio.run(reference_counts(tmp_path / "node"))
    assert counted  # the node's ledger counts its sessions' chunks

    # without the node's config the repair cannot see its manifests: refused, unchanged
    code = main(["repair", "--data-dir", str(tmp_path / "node"), "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "fleet node" in err and "nothing was changed" in err, err
    assert not list((tmp_path / "node" / "disk").glob("index.corrupt-*"))

    code = main(["repair", "--data-dir", str(tmp_path / "node"), "--config", config, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert sorted(json.loads(out)["sessions"] + json.loads(out)["incomplete"]) == [
        "acme/s0", "acme/s1"]
    assert asyncio.run(reference_counts(tmp_path / "node")) == counted
    asyncio.run(check_restores(shared("node"), sessions))
