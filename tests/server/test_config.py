"""Server configuration: presets, TOML file, KVTIER_* environment, overrides, sizes, and
the tier stack each configuration opens."""

from __future__ import annotations

import pytest

from kvstore.format.errors import InvalidRequest
from services.server.config_load import PRESETS, load_config
from services.server.config_values import parse_size
from services.server.store import open_manager


def test_precedence_preset_file_env_overrides(tmp_path):
    path = tmp_path / "kvtier.toml"
    path.write_text('preset = "test"\nhost_bytes = "8MiB"\nredis_url = "redis://a:1/0"\n'
                    'replay_workers = ["w1:50052", "w2:50052"]\n')
    config = load_config(path, env={"KVTIER_REDIS_URL": "redis://b:2/0",
                                    "KVTIER_HBM_BYTES": "1GiB"},
                         overrides={"host_bytes": "2MiB", "listen": None})
    assert config.listen == PRESETS["test"].listen  # None overrides nothing
    assert config.host_bytes == 2 << 20 and config.hbm_bytes == 1 << 30
    assert config.redis_url == "redis://b:2/0"
    assert config.replay_workers == ("w1:50052", "w2:50052")
    assert config.replay_mode == "remote"


def test_env_lists_s3_and_defaults():
    config = load_config(env={"KVTIER_REPLAY_WORKERS": "a:1, b:2",
                              "KVTIER_S3_BUCKET": "kv", "KVTIER_S3_PREFIX": "p/",
                              "KVTIER_S3_ENDPOINT": "http://127.0.0.1:9000"})
    assert config.replay_workers == ("a:1", "b:2")
    assert config.object_url == "s3://kv/p/"
    embedded = load_config(env={})
    assert embedded.replay_mode == "in-process" and not embedded.redis_url
    assert embedded.object_url == str(embedded.data_dir / "objects")


@pytest.mark.parametrize(("text", "value"), [(4096, 4096), ("4096", 4096), ("64MiB", 64 << 20),
                                             ("1.5GB", 1_500_000_000), ("2 KiB", 2048)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("values", [
    {"KVTIER_HOST_BYTES": "lots"}, {"KVTIER_DEFAULT_ACK": "maybe"},
    {"KVTIER_REPLAY": "remote"}, {"KVTIER_PRESET": "nope"},
    {"KVTIER_HOST_BYTES": "0", "KVTIER_HBM_BYTES": "0"}, {"KVTIER_DISK_SEGMENT_BYTES": "0"},
    {"KVTIER_EVICTION": "fifo"},
])
def test_bad_values_are_refused(values):
    with pytest.raises(InvalidRequest):
        load_config(env=values)


def test_unknown_file_keys_are_refused(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("hots_bytes = 1\n")
    with pytest.raises(InvalidRequest, match="hots_bytes"):
        load_config(path, env={})


async def test_tier_stacks(tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    config = load_config(preset="test", env={"KVTIER_S3_BUCKET": s3_bucket,
                                             "KVTIER_S3_ENDPOINT": s3_server,
                                             "KVTIER_S3_REGION": "us-east-1"},
                         overrides={"data_dir": tmp_path / "a"})
    manager = await open_manager(config)
    try:
        assert [t.name for t in manager.tiers] == ["host", "disk", "object"]
        assert manager.tiers[-1].url == f"s3://{s3_bucket}/kvtier/"
    finally:
        await manager.close()
    memory_only = load_config(preset="test", env={},
                              overrides={"data_dir": tmp_path / "b", "disk_bytes": 0,
                                         "object_bytes": 0, "hbm_bytes": "1MiB"})
    manager = await open_manager(memory_only)
    try:
        assert [t.name for t in manager.tiers] == ["hbm", "host"]
    finally:
        await manager.close()


def test_the_example_config_file_loads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "deploy" / "kvtier.example.toml"
    config = load_config(path, env={})
    assert config.replay_mode == "remote" and config.object_url == "s3://kvtier-cold/kvtier/"
    assert config.host_bytes == 8 << 30 and config.metrics_port == 9100


async def test_disk_segment_bytes_reaches_the_disk_tier(tmp_path):
    config = load_config(preset="test", env={"KVTIER_DISK_SEGMENT_BYTES": "64KiB"},
                         overrides={"data_dir": tmp_path})
    assert config.disk_segment_bytes == 64 << 10
    manager = await open_manager(config)
    try:
        disk = next(t for t in manager.tiers if t.name == "disk")
        assert disk.segment_bytes == 64 << 10
        for i in range(3):
            await disk.put(f"k{i}", bytes([i]) * (40 << 10))
        assert len(disk.segments()) >= 2  # sealed at 64 KiB, not the 64 MiB default
    finally:
        await manager.close()


@pytest.mark.parametrize("eviction, policy", [("hint", "HintPolicy"), ("lru", "LRUPolicy")])
async def test_the_eviction_policy_reaches_every_tier(tmp_path, eviction, policy):
    config = load_config(preset="test", env={"KVTIER_EVICTION": eviction},
                         overrides={"data_dir": tmp_path})
    manager = await open_manager(config)
    try:
        assert {type(p).__name__ for p in manager.store.stack.policies} == {policy}
    finally:
        await manager.close()
