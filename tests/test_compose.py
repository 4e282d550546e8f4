"""docker-compose.yml and deploy/prometheus.yml agree with the config defaults: service
names, ports, the data volume, and the addresses the ``compose`` preset dials."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.server.config import DEFAULT_REPLAY_PORT, PRESETS, load_config

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _container_ports(service: dict) -> set[int]:
    return {int(str(p).split(":")[-1].split("/")[0]) for p in service.get("ports", [])}


def _config():
    """The server's config as the compose file starts it: preset, then its environment."""
    server = SERVICES["kvtier"]
    command = server["command"]
    preset = command[command.index("--preset") + 1]
    return load_config(preset=preset, env=server.get("environment", {}))


def test_every_part_is_there():
    assert {"redis", "kvtier", "replay-worker", "prometheus"} <= set(SERVICES)
    assert SERVICES["kvtier"]["command"][:2] == ["kvtier", "serve"]
    assert SERVICES["replay-worker"]["command"][:2] == ["kvtier", "replay-worker"]
    assert (ROOT / SERVICES["kvtier"]["build"]["dockerfile"]).is_file()


def test_server_ports_and_volume_match_the_config():
    config = _config()
    assert config.listen.startswith("0.0.0.0:")  # reachable from other containers
    assert _container_ports(SERVICES["kvtier"]) == {config.port, config.metrics_port}
    volumes = SERVICES["kvtier"]["volumes"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in volumes}
    assert mounts[str(config.data_dir)] in COMPOSE["volumes"]  # disk tier on a volume
    assert config.disk_bytes > 0 and config.object_url.startswith(str(config.data_dir))


def test_redis_and_replay_addresses_point_at_their_services():
    config = _config()
    redis_host, redis_port = config.redis_url.split("//")[1].split("/")[0].split(":")
    assert redis_host in SERVICES and int(redis_port) in _container_ports(SERVICES[redis_host])
    assert config.replay_mode == "remote"
    for address in config.replay_workers:
        host, port = address.split(":")
        worker = SERVICES[host]
        assert int(port) in _container_ports(worker)
        listen = worker["command"][worker["command"].index("--listen") + 1]
        assert int(listen.split(":")[1]) == int(port) == DEFAULT_REPLAY_PORT
    # The preset alone (no environment) dials the same services.
    assert PRESETS["compose"].redis_url == config.redis_url
    assert PRESETS["compose"].replay_workers == config.replay_workers


def test_prometheus_scrapes_the_server_metrics_port():
    prometheus = SERVICES["prometheus"]
    source = next(v.split(":")[0] for v in prometheus["volumes"] if "prometheus.yml" in v)
    scrape = yaml.safe_load((ROOT / source).read_text())
    targets = [t for job in scrape["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]]
    assert targets == [f"kvtier:{_config().metrics_port}"]
