"""docker-compose.yml and deploy/prometheus.yml agree with the config defaults: service
names, ports, the data volume, and the addresses the ``compose`` preset dials; and they
are safe by default: only kvtier's gRPC port published, the web UIs on loopback, Redis
behind a password, alerts sent to an Alertmanager, certificates for every advertised
name."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from cryptography import x509

from services.server.config import DEFAULT_REPLAY_PORT
from services.server.config_load import PRESETS, load_config
from services.server.devcerts import write_dev_set

ROOT = Path(__file__).resolve().parents[2]
REDIS_PASSWORD = "compose-test-password"
# ${VAR}, ${VAR:?message}, ${VAR:-default}, and $$ (a literal $), as compose reads them
VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?([?-])([^}]*))?\}")


def _interpolated(node, env: dict[str, str]):
    """``node`` (a parsed compose file) with its variables replaced as compose does;
    KeyError for a required one that ``env`` lacks."""
    if isinstance(node, dict):
        return {k: _interpolated(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolated(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, kind, rest = match.groups()
        if name in env:
            return env[name]
        if kind == "?":
            raise KeyError(name)
        return rest if kind == "-" else ""

    return VARIABLE.sub(one, node)


def _compose(name: str, env: dict[str, str] | None = None) -> dict:
    raw = yaml.safe_load((ROOT / name).read_text())
    return _interpolated(raw, {"REDIS_PASSWORD": REDIS_PASSWORD} if env is None else env)


COMPOSE = _compose("docker-compose.yml")
SERVICES = COMPOSE["services"]


def _container_ports(service: dict) -> set[int]:
    """The ports other services reach: published and exposed alike."""
    ports = [*service.get("ports", []), *service.get("expose", [])]
    return {int(str(p).split(":")[-1].split("/")[0]) for p in ports}


def _published(service: dict) -> list[tuple[str, int]]:
    """(host address, container port) of each port published on the host; "" is every
    interface."""
    out = []
    for spec in service.get("ports", []):
        parts = str(spec).split("/")[0].split(":")
        out.append((parts[0] if len(parts) == 3 else "", int(parts[-1])))
    return out


def _config():
    """The server's config as the compose file starts it: preset, then its environment."""
    server = SERVICES["kvtier"]
    command = server["command"]
    preset = command[command.index("--preset") + 1]
    return load_config(preset=preset, env=server.get("environment", {}))


def test_every_part_is_there():
    assert {"redis", "kvtier", "replay-worker", "prometheus", "grafana"} <= set(SERVICES)
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
    redis = urlsplit(config.redis_url)
    assert redis.hostname in SERVICES and redis.port in _container_ports(SERVICES[redis.hostname])
    assert config.replay_mode == "remote"
    for address in config.replay_workers:
        host, port = address.split(":")
        worker = SERVICES[host]
        assert int(port) in _container_ports(worker)
        listen = worker["command"][worker["command"].index("--listen") + 1]
        assert int(listen.split(":")[1]) == int(port) == DEFAULT_REPLAY_PORT
    # The preset alone (no environment) dials the same services.
    preset_redis = urlsplit(PRESETS["compose"].redis_url)
    assert (preset_redis.hostname, preset_redis.port) == (redis.hostname, redis.port)
    assert PRESETS["compose"].replay_workers == config.replay_workers


def test_prometheus_scrapes_the_server_metrics_port():
    prometheus = SERVICES["prometheus"]
    source = next(v.split(":")[0] for v in prometheus["volumes"] if "prometheus.yml" in v)
    scrape = yaml.safe_load((ROOT / source).read_text())
    targets = [t for job in scrape["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]]
    assert targets == [f"kvtier:{_config().metrics_port}"]


def _mounted(service: dict, target: str) -> Path:
    """The repository path ``service`` mounts at ``target``."""
    source = next(v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == target)
    return ROOT / source


def test_prometheus_loads_the_alert_rules_it_is_given():
    prometheus = SERVICES["prometheus"]
    scrape = yaml.safe_load(_mounted(prometheus, "/etc/prometheus/prometheus.yml").read_text())
    for rule_file in scrape["rule_files"]:
        rules = yaml.safe_load(_mounted(prometheus, rule_file).read_text())
        alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
        assert {"KVTierErrorRatioHigh", "KVTierDataLoss", "KVTierWritebackBacklog",
                "KVTierTierDown", "KVTierWritebackFailures"} <= alerts


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard():
    grafana = SERVICES["grafana"]
    provisioning = _mounted(grafana, "/etc/grafana/provisioning")
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    source = sources["datasources"][0]
    host, port = source["url"].split("//")[1].split(":")
    assert host in SERVICES and int(port) in _container_ports(SERVICES[host])
    provider = yaml.safe_load((provisioning / "dashboards" / "kvtier.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    dashboard = json.loads((_mounted(grafana, path) / "kvtier.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {source["uid"]}
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].startswith(path)


def test_every_kvtier_service_builds_its_image_and_checks_its_health():
    images = set()
    for name in ("kvtier", "replay-worker"):
        service = SERVICES[name]
        assert (ROOT / service["build"]["dockerfile"]).is_file()  # its own build
        images.add(service["image"])
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "kvtier", "health"]
        port = int(test[test.index("--server") + 1].split(":")[1])
        assert port in _container_ports(service)
        if "--tls-ca" in test:  # TLS on: the CA it names is a mounted file
            ca = test[test.index("--tls-ca") + 1]
            mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
            assert any(ca.startswith(target + "/") for target in mounts)
    assert len(images) == 2  # no service runs an image another one builds
    assert SERVICES["kvtier"]["depends_on"]["replay-worker"]["condition"] == "service_healthy"
    assert {"healthcheck"} <= set(SERVICES["prometheus"]) and "healthcheck" in SERVICES["grafana"]


def test_the_image_runs_unprivileged_with_a_healthcheck_and_without_triton():
    dockerfile = (ROOT / SERVICES["kvtier"]["build"]["dockerfile"]).read_text()
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert "HEALTHCHECK" in dockerfile and "kvtier\", \"health" in dockerfile
    assert "triton" not in dockerfile.split("HEALTHCHECK")[0].split("pip install", 1)[1]
    assert "[gpu]" not in dockerfile  # `pip install .` takes the hard dependencies only
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["gpu"])


# -- docker-compose.fleet.yml: two replicas sharing one Redis and one S3 endpoint --

FLEET = _compose("docker-compose.fleet.yml")
FLEET_SERVICES = FLEET["services"]
REPLICAS = [name for name, s in FLEET_SERVICES.items()
            if s.get("command", [])[:2] == ["kvtier", "serve"]]


def _replica_config(name: str):
    """A replica's config as compose starts it: its preset, then its own environment."""
    service = FLEET_SERVICES[name]
    command = service["command"]
    return load_config(preset=command[command.index("--preset") + 1],
                       env={k: str(v) for k, v in service["environment"].items()})


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.split("//")[-1].split("/")[0].split("@")[-1].rsplit(":", 1)
    return host, int(port)


def test_the_fleet_runs_two_replicas_of_one_image_with_their_own_node_ids():
    assert len(REPLICAS) == 2
    configs = [_replica_config(name) for name in REPLICAS]
    assert {c.metadata for c in configs} == {"shared"}
    assert len({c.node_name for c in configs}) == 2
    assert len({FLEET_SERVICES[n]["image"] for n in REPLICAS}) == 1
    assert (ROOT / FLEET_SERVICES[REPLICAS[0]]["build"]["dockerfile"]).is_file()
    for name, config in zip(REPLICAS, configs, strict=True):
        # what Stat reports as a window's node address: this service, on its gRPC port
        host, port = _host_port(config.advertise_address)
        assert host == name and port == config.port and config.listen.startswith("0.0.0.0:")
        assert config.replay_mode == "in-process"  # no worker service in this file


def test_the_replicas_share_one_redis_and_one_bucket_that_exist_before_they_start():
    configs = [_replica_config(name) for name in REPLICAS]
    assert len({(c.redis_url, c.s3_endpoint, c.s3_bucket, c.s3_region) for c in configs}) == 1
    config = configs[0]
    redis_host, _ = _host_port(config.redis_url)
    s3_host, s3_port = _host_port(config.s3_endpoint)
    assert redis_host in FLEET_SERVICES and s3_host in FLEET_SERVICES
    assert s3_port in _container_ports(FLEET_SERVICES[s3_host])
    bucket_job = next(s for s in FLEET_SERVICES.values()
                      if "create-bucket" in s.get("command", []))
    command = bucket_job["command"]
    assert command[command.index("--bucket") + 1] == config.s3_bucket
    assert _host_port(command[command.index("--endpoint-url") + 1]) == (s3_host, s3_port)
    job_name = next(n for n, s in FLEET_SERVICES.items() if s is bucket_job)
    for name in REPLICAS:
        needs = FLEET_SERVICES[name]["depends_on"]
        assert needs[redis_host]["condition"] == "service_healthy"
        assert needs[job_name]["condition"] == "service_completed_successfully"
        env = FLEET_SERVICES[name]["environment"]
        assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]  # boto3 reads these


def test_each_replica_has_its_own_ports_and_volume_and_a_grpc_healthcheck():
    host_ports, volumes = set(), set()
    for name in REPLICAS:
        service, config = FLEET_SERVICES[name], _replica_config(name)
        assert _container_ports(service) == {config.port, config.metrics_port}
        host_ports |= {int(str(p).split(":")[0]) for p in service["ports"]}
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        assert mounts[str(config.data_dir)] in FLEET["volumes"]
        volumes.add(mounts[str(config.data_dir)])
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "kvtier", "health"]
        assert int(test[test.index("--server") + 1].split(":")[1]) == config.port
        ca = test[test.index("--tls-ca") + 1]
        assert any(ca.startswith(target + "/") for target in mounts)
        config_file = service["command"][service["command"].index("--config") + 1]
        assert (ROOT / mounts[config_file]).is_file()
    assert len(host_ports) == 2 and len(volumes) == 2  # nothing shared but redis and S3


# -- safe by default, both files --

FILES = {"docker-compose.yml": SERVICES, "docker-compose.fleet.yml": FLEET_SERVICES}
WEB_UIS = ("prometheus", "grafana", "alertmanager")


def _servers(services: dict) -> dict[str, object]:
    """The kvtier servers of a compose file -> their configs as compose starts them."""
    out = {}
    for name, service in services.items():
        command = service.get("command", [])
        if command[:2] == ["kvtier", "serve"]:
            out[name] = load_config(preset=command[command.index("--preset") + 1],
                                    env={k: str(v) for k, v in service["environment"].items()})
    return out


def test_only_kvtier_grpc_is_published_and_the_web_uis_only_on_loopback():
    for file, services in FILES.items():
        servers = _servers(services)
        assert servers, file
        for name, service in services.items():
            published = _published(service)
            if name in servers:  # TLS and tokens: the one port for other machines
                assert [port for _, port in published] == [servers[name].port], (file, name)
            elif name in WEB_UIS:
                assert published and {host for host, _ in published} == {"127.0.0.1"}, name
            else:  # redis, moto, the replay worker: the compose network only
                assert not published, (file, name, published)


def test_redis_wants_a_password_and_kvtier_dials_it_with_that_password():
    for file, services in FILES.items():
        redis = services["redis"]
        command = redis["command"]
        assert command[0] == "redis-server", file  # the image then runs it unprivileged
        assert command[command.index("--requirepass") + 1] == REDIS_PASSWORD, file
        assert redis["environment"]["REDISCLI_AUTH"] == REDIS_PASSWORD  # healthcheck's too
        assert redis["healthcheck"]["test"][:2] == ["CMD", "redis-cli"]
        for name, config in _servers(services).items():
            url = urlsplit(config.redis_url)
            assert (url.hostname, url.password) == ("redis", REDIS_PASSWORD), (file, name)
        # No default password: without REDIS_PASSWORD compose refuses to start.
        raw = (ROOT / file).read_text()
        assert "${REDIS_PASSWORD:?" in raw and "${REDIS_PASSWORD:-" not in raw
        try:
            _compose(file, env={})
        except KeyError as missing:
            assert missing.args == ("REDIS_PASSWORD",)
        else:
            raise AssertionError(f"{file} starts without REDIS_PASSWORD")


def test_the_fleet_acks_durably():
    # a session moves between replicas: a memory ack dies with the replica holding it
    assert {c.default_ack for c in _servers(FLEET_SERVICES).values()} == {"durable"}


def _dialled_names() -> set[str]:
    """Every service name a compose file dials over TLS or advertises: advertise
    addresses, replay workers, healthcheck and scrape targets."""
    names = set()
    for services in FILES.values():
        for name, config in _servers(services).items():
            names.add(name)
            names |= {a.rpartition(":")[0] for a in config.replay_workers}
            if config.advertise_address:
                names.add(config.advertise_address.rpartition(":")[0])
        for service in services.values():
            test = service.get("healthcheck", {}).get("test", [])
            if "--server" in test:
                names.add(test[test.index("--server") + 1].rpartition(":")[0])
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    names |= {t.rpartition(":")[0] for job in scrape["scrape_configs"]
              for c in job["static_configs"] for t in c["targets"]}
    return names


def test_the_development_certificate_covers_every_name_the_compose_files_dial(tmp_path):
    names = _dialled_names()
    assert {"kvtier", "kvtier-a", "kvtier-b", "replay-worker", "127.0.0.1"} <= names
    assert "kvtier certs deploy/dev-certs" in (ROOT / "Makefile").read_text()  # no --name
    write_dev_set(tmp_path)
    cert = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    covered = set(san.get_values_for_type(x509.DNSName)) | {
        str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert names <= covered, names - covered


def test_prometheus_sends_alerts_to_the_alertmanager_service():
    prometheus = SERVICES["prometheus"]
    scrape = yaml.safe_load(_mounted(prometheus, "/etc/prometheus/prometheus.yml").read_text())
    targets = [t for entry in scrape["alerting"]["alertmanagers"]
               for c in entry["static_configs"] for t in c["targets"]]
    assert targets
    for target in targets:
        host, port = _host_port(target)
        service = SERVICES[host]
        assert service["image"].startswith("prom/alertmanager:")
        assert port in _container_ports(service)
        assert "condition" in prometheus["depends_on"][host]
        command = service["command"]
        config_path = next(c.split("=", 1)[1] for c in command if c.startswith("--config.file="))
        config = yaml.safe_load(_mounted(service, config_path).read_text())
        receivers = {r["name"] for r in config["receivers"]}
        routes = [config["route"], *config["route"].get("routes", [])]
        assert {r["receiver"] for r in routes if "receiver" in r} <= receivers
