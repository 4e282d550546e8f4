"""``kvtier backup --bucket`` and ``kvtier restore-backup --bucket`` on moto's S3 server:
a fleet's prefix backed up, restored to another prefix and served there bit-exact; a
chunk damaged in the backup is caught after upload, and the prefix is left empty."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3

from services.cli.backup import MANIFEST, digest
from services.server.config import ServerConfig
from services.server.store import open_manager
from tests.support.fleet import shared_config
from tests.support.manager import make_session, random_tokens
from tests.support.servers import MotoServer

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = ("s0", "s1", "s2")


def kvtier(endpoint: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "AWS_"))}
    env |= {"PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    return subprocess.run([sys.executable, "-m", "services.cli", *args, "--s3-endpoint",
                           endpoint, "--json"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


def node_config(tmp_path: Path, endpoint: str, bucket: str, node: str, prefix: str):
    return shared_config(tmp_path, endpoint, bucket, "us-east-1", node, s3_prefix=prefix)


async def fill(config) -> dict[str, dict]:
    manager = await open_manager(config)
    try:
        sessions = {}
        for i, name in enumerate(SESSIONS):
            args = make_session(random_tokens(16 * 3 + i, seed=40 + i), seed=i,
                                window=False, tenant="acme")
            await manager.spill("acme", name, generation=1, ack="durable", **args)
            sessions[name] = args
        return sessions
    finally:
        await manager.close()


async def read_back(config, sessions: dict[str, dict]) -> None:
    manager = await open_manager(config)
    try:
        for name, args in sessions.items():
            result = await manager.restore("acme", name)
            assert [bytes(c) for c in result.chunks] == [bytes(c) for _, c in args["chunks"]]
            assert bytes(result.manifest.tail) == bytes(args["tail"])
    finally:
        await manager.close()


def prefix_keys(endpoint: str, bucket: str, prefix: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=endpoint, **MotoServer.CREDENTIALS)
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
            .get("Contents", [])]


def test_a_bucket_prefix_round_trips_and_damage_leaves_it_empty(tmp_path, s3_server,
                                                                 s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MotoServer.CREDENTIALS["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY",
                       MotoServer.CREDENTIALS["aws_secret_access_key"])
    sessions = asyncio.run(fill(node_config(tmp_path, s3_server, s3_bucket, "n1", "live/")))
    s3 = boto3.client("s3", endpoint_url=s3_server, **MotoServer.CREDENTIALS)
    s3.put_object(Bucket=s3_bucket, Key="live/fleet/nodes/n1.json",  # a live node's heartbeat
                  Body=b'{"node_id": "n1", "address": "", "state": "serving", "unix": 0}')
    out = tmp_path / "backup"
    done = kvtier(s3_server, "backup", "--bucket", f"s3://{s3_bucket}/live/", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    made = json.loads(done.stdout)
    assert made["sessions"] == len(SESSIONS) and made["chunks"] > 0
    backed = [f["key"] for f in json.loads((out / MANIFEST).read_text())["files"]]
    assert not [key for key in backed if key.startswith("fleet/nodes/")]  # not data

    restored = kvtier(s3_server, "restore-backup", str(out), "--bucket",
                      f"s3://{s3_bucket}/restored/")
    assert restored.returncode == 0, restored.stderr[-3000:]
    assert json.loads(restored.stdout)["sessions"] == len(SESSIONS)
    asyncio.run(read_back(node_config(tmp_path, s3_server, s3_bucket, "n2", "restored/"),
                          sessions))
    again = kvtier(s3_server, "restore-backup", str(out), "--bucket",
                   f"s3://{s3_bucket}/restored/")
    assert again.returncode == 2 and "not empty" in again.stderr

    # a session's manifest lost with its listing: the census names it, nothing is uploaded
    short = tmp_path / "short"
    shutil.copytree(out, short)
    listing = json.loads((short / MANIFEST).read_text())
    dropped = next(f for f in listing["files"] if f["key"].startswith("fleet/manifest/"))
    listing["files"].remove(dropped)
    (short / MANIFEST).write_text(json.dumps(listing))
    (short / dropped["path"]).unlink()
    lost = kvtier(s3_server, "restore-backup", str(short), "--bucket",
                  f"s3://{s3_bucket}/short/")
    assert lost.returncode == 1 and "DATA_LOSS" in lost.stderr, lost.stderr[-2000:]
    assert any("not restored" in line for line in json.loads(lost.stdout)["missing"])
    assert prefix_keys(s3_server, s3_bucket, "short/") == []

    # a chunk damaged in the backup, its digest made to agree: the scrub finds it
    manifest = json.loads((out / MANIFEST).read_text())
    chunk = next(f for f in manifest["files"] if f["key"].endswith(".bin"))
    body = bytearray((out / chunk["path"]).read_bytes())
    body[len(body) // 2] ^= 0xFF
    (out / chunk["path"]).write_bytes(bytes(body))
    chunk["blake2b"] = digest(out / chunk["path"])
    (out / MANIFEST).write_text(json.dumps(manifest))
    lost = kvtier(s3_server, "restore-backup", str(out), "--bucket",
                  f"s3://{s3_bucket}/damaged/")
    assert lost.returncode == 1 and "DATA_LOSS" in lost.stderr
    assert prefix_keys(s3_server, s3_bucket, "damaged/") == []

    as_dir = kvtier(s3_server, "restore-backup", str(out), str(tmp_path / "d"))
    assert as_dir.returncode == 2 and "--bucket" in as_dir.stderr


def test_a_node_with_an_s3_object_tier_restores_with_its_config(tmp_path, s3_server,
                                                                 s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", MotoServer.CREDENTIALS["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY",
                       MotoServer.CREDENTIALS["aws_secret_access_key"])
    data, out, target = tmp_path / "data", tmp_path / "backup", tmp_path / "restored"

    def config(data_dir: Path):
        return ServerConfig(data_dir=data_dir, host_bytes=8 << 20, disk_bytes=64 << 20,
                            object_bytes=1 << 30, s3_endpoint=s3_server, s3_bucket=s3_bucket,
                            s3_region="us-east-1", object_compression_level=-1)

    async def fill_and_demote():
        sessions = await fill(config(data))
        manager = await open_manager(config(data))
        try:
            await manager.demote("acme", "s0", "object")
        finally:
            await manager.close()
        return sessions

    sessions = asyncio.run(fill_and_demote())
    done = kvtier(s3_server, "backup", "--data-dir", str(data), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    blind = kvtier(s3_server, "restore-backup", str(out), str(tmp_path / "blind"))
    assert blind.returncode == 1 and "acme/s0" in blind.stderr  # demoted: in S3 only
    toml = tmp_path / "node.toml"
    toml.write_text(f'object_bytes = {1 << 30}\ns3_endpoint = "{s3_server}"\n'
                    f's3_bucket = "{s3_bucket}"\ns3_region = "us-east-1"\n')
    restored = kvtier(s3_server, "restore-backup", str(out), str(target), "--config", str(toml))
    assert restored.returncode == 0, restored.stderr[-3000:]
    assert json.loads(restored.stdout)["missing"] == []
    asyncio.run(read_back(config(target), sessions))
