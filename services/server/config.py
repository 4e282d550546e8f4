"""Server configuration: one dataclass and its rules; ``config_load`` builds one from a preset,
a TOML file and ``KVTIER_*`` env vars.

Precedence, lowest first: the preset (``embedded`` unless the file or ``KVTIER_PRESET``
names another), the TOML file (top-level keys are the field names below), the environment
(``KVTIER_`` + the field name in upper case, e.g. ``KVTIER_REDIS_URL``), and explicit
overrides (the ``kvtier serve`` flags). Sizes accept plain byte counts or ``"64MiB"``-style
strings; lists (``replay_workers``) accept a comma-separated string. ``dedupe_domains`` is a
TOML table (``[dedupe_domains]`` then ``public = ["acme", "beta"]``) or, in the environment,
``public=acme,beta;other=gamma``. Quotas (``kvstore.session.quota``) are ``[quota.default]``
and ``[quota.<tenant>]`` tables of ``memory_bytes``, ``durable_bytes`` and ``sessions`` or,
in the environment, ``default.sessions=200;acme.memory_bytes=1GiB``.

The ``embedded`` preset needs nothing installed: a data directory on local disk holding the
disk tier and the object tier (a local directory), the host RAM tier, no Redis, and replay
in the server's process.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvstore.format.errors import InvalidRequest
from kvstore.format.layout import REPLAYERS
from kvstore.tiers.common import without_password
from services.server.address_file import WILDCARD_HOSTS
from services.server.config_values import (
    GiB,
    KiB,
    MiB,
    TiB,
    check_domains,
    check_listen,
    check_url,
)

ENV_PREFIX = "KVTIER_"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9100
DEFAULT_REPLAY_PORT = 50052
ACKS = ("memory", "durable")
REPLAY_MODES = ("auto", "in-process", "remote", "streams", "off")
LAYOUT_POLICIES = ("auto", "admin", "any", "none")  # register_layouts
EVICTION_POLICIES = ("reuse", "hint", "lru")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# What kvstore.tiers.redis.RedisTier connects to, and what boto3 takes as an endpoint.
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "unix")
S3_ENDPOINT_SCHEMES = ("http", "https")


@dataclass(frozen=True)
class ServerConfig:
    listen: str = f"127.0.0.1:{DEFAULT_PORT}"  # host:port; port 0 picks a free one
    data_dir: Path = Path("data")
    # Tiers, highest first; a capacity of 0 (or an empty URL) leaves the tier out.
    hbm_bytes: int = 0
    host_bytes: int = 1 * GiB
    redis_url: str = ""  # redis://host:port/db or redis+cluster://host:port
    redis_bytes: int = 4 * GiB
    redis_preset: str = "datacenter"  # kvstore.tiers.redis.REDIS_PRESETS
    redis_prefix: str = "kvtier:"
    disk_bytes: int = 64 * GiB  # under data_dir/disk
    disk_segment_bytes: int = 64 * MiB  # a disk segment file is sealed at this size
    # The server rewrites a sealed disk segment itself once this fraction of it is dead
    # (deleted or overwritten records), at most once per interval; 1 or more: never.
    disk_reclaim_dead_fraction: float = 0.5
    disk_reclaim_interval_s: float = 5.0
    object_bytes: int = 1 * TiB  # S3 when s3_bucket is set, else data_dir/objects
    s3_endpoint: str = ""  # empty: AWS itself
    s3_bucket: str = ""
    s3_prefix: str = "kvtier/"
    s3_region: str = ""
    # Deadlines of the remote dependencies: S3's connect and read timeouts and the most
    # one S3 call is waited for, retries included; Redis's likewise (0: redis_preset's);
    # one call to a remote replay worker. One that failed so is skipped (fails fast, its
    # tier reported down) for breaker_cooldown_s, then probed by one call (kvstore.remote.breaker).
    s3_connect_timeout_s: float = 1.0
    s3_read_timeout_s: float = 10.0
    s3_deadline_s: float = 15.0
    redis_connect_timeout_s: float = 0.0
    redis_socket_timeout_s: float = 0.0
    redis_deadline_s: float = 0.0
    replay_timeout_s: float = 120.0
    breaker_cooldown_s: float = 5.0
    # Every remote dependency (Redis, the S3 bucket, hence the fleet's shared metadata)
    # is asked whether it answers this often, busy or idle (services.server.probes): its
    # tier_up and breaker say what is true now, and an open breaker half-opens on this
    # timer, not only when a request comes. gRPC health says NOT_SERVING while one of
    # required_tiers that is configured is down ([]: health ignores the tiers); "replay":
    # every remote replay worker (replay_workers, replay_hf_workers) is down.
    probe_interval_s: float = 5.0
    required_tiers: tuple[str, ...] = ("redis", "object")
    object_compression_level: int = 3  # zstd on the slowest tier; -1 stores raw bytes
    # Fleet (docs/fleet.md): "shared" keeps the manifests in the S3 bucket (compare and
    # swap), so any server sharing it resumes any session; "local": in data_dir.
    metadata: str = "local"
    node_id: str = ""  # this server in the fleet; empty: hostname:port
    # The fleet's sweep (kvtier fleet-gc, docs/fleet.md) deletes a chunk no manifest names
    # once it was written over fleet_gc_grace_s ago (spills write chunks before their
    # manifest) and a sweep first saw it unnamed over fleet_retain_s ago (prefix cache).
    fleet_gc_grace_s: float = 3600.0
    fleet_retain_s: float = 86400.0
    # Each fleet node writes a heartbeat to the bucket this often (kvstore.fleet.liveness);
    # `kvtier stat --fleet` shows a node down once its last one is fleet_down_after_s old.
    fleet_heartbeat_s: float = 10.0
    fleet_down_after_s: float = 30.0
    # host:port other nodes and routers reach this server at, recorded in its manifests
    # beside node_id (Stat's window_node_address); empty: the bound listen address, a
    # wildcard host (0.0.0.0) replaced by this host's name.
    advertise_address: str = ""
    # Behaviour.
    default_ack: str = "memory"  # what ACK_UNSPECIFIED means
    # reuse: kvstore.eviction.reuse.ReusePolicy (reuse learned from every tier's reads, per
    # read count and resume hint, per byte; retained chunks ranked with the rest); hint:
    # kvstore.eviction.policies.HintPolicy (resume hints, sent or inferred; LRU order without any;
    # retained chunks first); lru: LRUPolicy, hints ignored.
    eviction: str = "reuse"
    # REPLAY_MODES; auto: remote when replay_workers are named, else streams when
    # replay_redis_url is set, else in-process.
    replay: str = "auto"
    replay_workers: tuple[str, ...] = ()  # host:port of `kvtier replay-worker`s
    replay_redis_url: str = ""  # Redis Streams job queue (default for streams: redis_url)
    replay_tokens: int = 128  # R when a request says 0 and its layout states none
    replay_max_batch: int = 8  # in-process replay: concurrent resumes per model call
    replay_weights: str = ""  # in-process replay: model weights (default: the bundled ones)
    # in-process replay: load the model and run it once before health says SERVING
    replay_warmup: bool = True
    # In-process replay of transformers DeepseekV4 layouts (replayer
    # "transformers-deepseek-v4"): a save_pretrained directory, or a config JSON whose
    # weights are drawn at random from replay_hf_seed (replay.transformers_worker).
    replay_hf_model: str = ""
    replay_hf_seed: int = 0
    # ... or on `kvtier replay-worker --hf-model` processes instead (host:port, taken in
    # turn as replay_workers are, reached with the replay_tls_* settings).
    replay_hf_workers: tuple[str, ...] = ()
    prefetch_timeout_s: float = 30.0  # when a Prefetch request says 0
    # One gRPC message, either direction. gRPC copies each message it receives on the
    # event loop, so this bounds how long one message holds it (services.server.sizes);
    # every shipped layout's chunk and window fit.
    max_message_bytes: int = 8 * MiB
    # A Spill header or a Lookup request (token ids, chain keys): parsed and checked on
    # the event loop, so its size bounds that work; 6 MiB carry 1.5M token ids.
    max_header_bytes: int = 6 * MiB
    max_spill_bytes: int = 4 * GiB  # one Spill stream, all payloads together
    # What clients may hold open (services.server.limits); past a bound RESOURCE_EXHAUSTED.
    max_streams: int = 512  # Spill, Restore and Resume streams open at once, all clients
    max_peer_streams: int = 64  # the same, one client connection
    stream_idle_s: float = 60.0  # a Spill stream that sends nothing this long is cancelled
    max_inflight_bytes: int = 8 * GiB  # bytes of not yet committed spills, all tenants
    max_tenant_inflight_bytes: int = 4 * GiB  # the same, one tenant
    # Shared memory (same-host fast path): segments the server leases to clients.
    shm_lease_s: float = 120.0  # a lease unused this long is unlinked
    shm_lease_bytes_per_client: int = 2 * GiB  # leased to one connection at once
    shm_lease_bytes_total: int = 8 * GiB  # leased to all clients at once
    metrics_port: int = 0  # 0: no Prometheus endpoint
    metrics_interval_s: float = 2.0  # how often tier figures are refreshed for metrics
    log_level: str = "INFO"  # `kvtier serve --log-level` overrides; reloaded on SIGHUP
    grace_s: float = 10.0  # in-flight RPCs get this long at shutdown
    # Log lines as "text" or "json" (one object a line); a call taking at least
    # slow_request_s logs a warning with its phases (0: off) (services.server.requests).
    log_format: str = "text"
    slow_request_s: float = 1.0
    # OTLP/gRPC collector for spans of Spill, Restore, Resume and replay, e.g.
    # "http://127.0.0.1:4317" (empty: no tracing) (services.server.tracing)
    otlp_endpoint: str = ""
    manager_preset: str = "embedded"  # kvstore.session.manager.MANAGER_PRESETS
    # true: chunks no session names any more stay as evictable cache for prefix reuse
    # (Lookup, kvstore.prefix.chains.Retention), accounted to their dedupe domain, until a tier's
    # capacity, a full medium or the tenant's durable_bytes quota needs their room, or
    # they sit unused for retain_ttl_s (0: no TTL); false frees them with their last
    # reference.
    retain_unreferenced: bool = True
    retain_ttl_s: float = 0.0
    # Shared dedupe domains: name -> the tenants that may spill into it (e.g. for a public
    # system prompt). Every other chunk dedupes only within its own tenant.
    dedupe_domains: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Per-tenant quotas: "default" and tenant -> {memory_bytes, durable_bytes, sessions};
    # a tenant's table overrides the default's key by key, an absent key is unlimited.
    quota: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    # Encryption at rest (kvstore.encryption.seal) of the redis, disk and object tiers and the
    # manifests: a TOML file of [[key]] id, material (base64 of 32 bytes), current; or
    # one base64 key in KVTIER_ENCRYPTION_KEY. Never shown (summary, repr, logs).
    encryption_key_file: str = ""
    encryption_key: str = field(default="", repr=False)
    # Security (README "Security"). TLS from PEM files; mTLS when tls_client_ca is set.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # client certificates must chain to this CA
    # Authentication (services.serving.auth): a TOML file of [[token]] (sha256, tenant,
    # role) and [[client_cert]] (cn, tenant, role), reloaded when it changes; and/or JWTs
    # checked with auth_jwt_key (a PEM public key file, a file holding a shared secret,
    # or the secret itself) for auth_jwt_audience.
    auth_tokens_file: str = ""
    auth_jwt_key: str = ""
    auth_jwt_audience: str = ""
    audit_log: str = ""  # JSON lines: auth failures, denials, admin actions, deletes
    reflection: bool = False  # gRPC server reflection (it lists the services to anyone)
    metrics_host: str = "127.0.0.1"  # the Prometheus endpoint's address (TLS like gRPC)
    # How this server reaches replay_workers: their CA, a client certificate for mTLS,
    # a file holding a bearer token of role "replay".
    replay_tls_ca: str = ""
    replay_tls_cert: str = ""
    replay_tls_key: str = ""
    replay_token_file: str = ""
    # How this fleet node reaches its peers when it drains (AdoptWindow, services.server.peers):
    # their CA, a client certificate for mTLS (a [[client_cert]] of role "peer" there),
    # a file holding a bearer token of role "peer".
    peer_tls_ca: str = ""
    peer_tls_cert: str = ""
    peer_tls_key: str = ""
    peer_token_file: str = ""
    # The layouts' replayers (kvstore.format.layout.REPLAYERS) the replay backend runs: a Resume
    # that needs a replay of a layout whose replayer is not here answers
    # ReplayUnavailable. Empty: "bundled" (the in-process model, and what the bundled
    # `kvtier replay-worker` runs), and "transformers-deepseek-v4" with replay_hf_model or
    # replay_hf_workers; with replay off, none. With replay = "streams", list
    # "transformers-deepseek-v4" here when `--hf-model` workers read its stream.
    replayers: tuple[str, ...] = ()
    # Layouts at run time (services.server.layout_registry): who may call RegisterLayout (admin,
    # any, none; auto: admin when the server authenticates, else any), and layouts served
    # besides the presets: canonical layout JSON inline, or paths of JSON files holding
    # one layout or a list of them (in the environment: paths, comma-separated).
    register_layouts: str = "auto"
    layouts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_addresses(self)
        _check_choices(self)
        _check_replay(self)
        _check_durations(self)
        _check_sizes(self)
        _check_bounds(self)
        check_domains(self.dedupe_domains)
        unknown_tiers = set(self.required_tiers) - {"redis", "object", "replay"}
        if unknown_tiers:
            raise InvalidRequest(f"required_tiers: {sorted(unknown_tiers)} are not remote "
                                 "dependencies; name 'redis', 'object' and/or 'replay'")
        if self.quota:
            from kvstore.session.quota import Quotas  # loads the store's modules: only when used

            Quotas.from_tables(self.quota)  # refuses unknown keys, bad values, bad tenants
        object.__setattr__(self, "quota", MappingProxyType({
            name: MappingProxyType(dict(table)) for name, table in self.quota.items()}))
        object.__setattr__(self, "dedupe_domains", {
            name: tuple(tenants) for name, tenants in self.dedupe_domains.items()})
        _check_pairs(self)
        _check_fleet(self)
        _check_layout_settings(self)
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        object.__setattr__(self, "replay_workers", tuple(self.replay_workers))
        object.__setattr__(self, "replay_hf_workers", tuple(self.replay_hf_workers))
        object.__setattr__(self, "replayers", tuple(self.replayers))
        object.__setattr__(self, "required_tiers", tuple(self.required_tiers))
        object.__setattr__(self, "layouts", tuple(self.layouts))

    @property
    def replay_mode(self) -> str:
        if self.replay == "auto":
            if self.replay_workers:
                return "remote"
            return "streams" if self.replay_redis_url else "in-process"
        return self.replay

    @property
    def replay_layouts(self) -> frozenset[str]:
        """The replayers whose layouts this server's Resume can rebuild a window for."""
        if self.replay_mode == "off":
            return frozenset()
        hf = self.replay_hf_model or self.replay_hf_workers
        default = ("bundled",) + (("transformers-deepseek-v4",) if hf else ())
        return frozenset(self.replayers or default)

    @property
    def layout_policy(self) -> str:
        """Who may register layouts: ``register_layouts`` with auto resolved."""
        if self.register_layouts == "auto":
            return "admin" if self.authenticates else "any"
        return self.register_layouts

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def authenticates(self) -> bool:
        """Whether the tenant of a request comes from its credential."""
        return bool(self.auth_tokens_file or self.auth_jwt_key)

    @property
    def encrypts(self) -> bool:
        """Whether values leaving the process are sealed (``kvstore.encryption.seal``)."""
        return bool(self.encryption_key_file or self.encryption_key)

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @property
    def node_name(self) -> str:
        """``node_id``, or this host's name and the listen port."""
        return self.node_id or f"{socket.gethostname()}:{self.port}"

    def advertised(self, port: int) -> str:
        """``advertise_address``, or the listen address with the port bound (``port``)."""
        if self.advertise_address or self.listen.startswith("unix:"):
            return self.advertise_address or self.listen
        host = self.listen.rpartition(":")[0]
        if host in WILDCARD_HOSTS:
            host = socket.gethostname()
        return f"{host}:{port}"

    @property
    def object_url(self) -> str:
        if self.s3_bucket:
            return f"s3://{self.s3_bucket}/{self.s3_prefix}"
        return str(self.data_dir / "objects")

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)

    def summary(self) -> dict[str, Any]:
        # shallow: quota is read-only
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["quota"] = {name: dict(table) for name, table in self.quota.items()}
        out["data_dir"] = str(self.data_dir)
        out["dedupe_domains"] = {k: list(v) for k, v in self.dedupe_domains.items()}
        out["replay_workers"] = list(self.replay_workers)
        out["replay_hf_workers"] = list(self.replay_hf_workers)
        if self.encryption_key:
            out["encryption_key"] = "<secret>"
        for name in ("redis_url", "replay_redis_url"):
            out[name] = without_password(out[name])
        if self.auth_jwt_key and not Path(self.auth_jwt_key).is_file():
            out["auth_jwt_key"] = "<secret>"  # a shared secret given inline
        return out


def _check_addresses(config: ServerConfig) -> None:
    """Listen and advertise addresses, the Redis URLs and the S3 endpoint and bucket."""
    check_listen("listen", config.listen)
    if config.advertise_address:
        check_listen("advertise_address", config.advertise_address)
    for name in ("redis_url", "replay_redis_url"):
        check_url(name, getattr(config, name), REDIS_SCHEMES)
    check_url("s3_endpoint", config.s3_endpoint, S3_ENDPOINT_SCHEMES)
    if (config.s3_endpoint or config.s3_region) and not config.s3_bucket:
        # Without a bucket the object tier is a local directory: the endpoint would
        # be ignored without a word.
        raise InvalidRequest("s3_endpoint or s3_region is set but s3_bucket is empty: "
                             "name the bucket, or unset both for a local object tier")
    if config.s3_bucket and "/" in config.s3_bucket:
        raise InvalidRequest(f"s3_bucket is a bucket name, got {config.s3_bucket!r}")


def _check_choices(config: ServerConfig) -> None:
    """Settings that name one of a few choices."""
    if config.metadata not in ("local", "shared"):
        raise InvalidRequest(f"metadata must be 'local' or 'shared', got {config.metadata!r}")
    if config.log_format not in ("text", "json"):
        raise InvalidRequest(f"log_format must be 'text' or 'json', got {config.log_format!r}")
    if config.default_ack not in ACKS:
        raise InvalidRequest(f"default_ack must be one of {ACKS}, got {config.default_ack!r}")
    if config.eviction not in EVICTION_POLICIES:
        raise InvalidRequest(f"eviction must be one of {EVICTION_POLICIES}, "
                             f"got {config.eviction!r}")
    if config.replay not in REPLAY_MODES:
        raise InvalidRequest(f"replay must be one of {REPLAY_MODES}, got {config.replay!r}")
    if config.log_level.upper() not in LOG_LEVELS:
        raise InvalidRequest(f"log_level must be one of {LOG_LEVELS}, got "
                             f"{config.log_level!r}")


def _check_replay(config: ServerConfig) -> None:
    """How windows are rebuilt: the replay mode and its workers."""
    if config.replay == "remote" and not (config.replay_workers or config.replay_hf_workers):
        raise InvalidRequest("replay = 'remote' needs at least one replay_workers (or "
                             "replay_hf_workers) address")
    if config.replay_hf_model and config.replay_hf_workers:
        raise InvalidRequest("replay_hf_model (in this process) and replay_hf_workers "
                             "(remote workers) both replay transformers layouts: set one")
    if config.replay == "streams" and not (config.replay_redis_url or config.redis_url):
        raise InvalidRequest("replay = 'streams' needs replay_redis_url or redis_url")


def _check_durations(config: ServerConfig) -> None:
    """Timeouts and intervals."""
    if config.slow_request_s < 0:
        raise InvalidRequest(f"slow_request_s must be >= 0 (0: off), got "
                             f"{config.slow_request_s}")
    if config.fleet_gc_grace_s < 0 or config.fleet_retain_s < 0:
        raise InvalidRequest("fleet_gc_grace_s and fleet_retain_s must be >= 0")
    if not 0 < config.fleet_heartbeat_s < config.fleet_down_after_s:
        raise InvalidRequest("fleet_heartbeat_s must be > 0 and below fleet_down_after_s "
                             f"(a node is down after missing a few), got "
                             f"{config.fleet_heartbeat_s} and {config.fleet_down_after_s}")
    for name in ("s3_connect_timeout_s", "s3_read_timeout_s", "s3_deadline_s",
                 "replay_timeout_s", "breaker_cooldown_s", "redis_connect_timeout_s",
                 "redis_socket_timeout_s", "redis_deadline_s", "probe_interval_s"):
        if not getattr(config, name) > 0 and not (name.startswith("redis_")
                                                and getattr(config, name) == 0):
            raise InvalidRequest(f"{name} must be > 0 (redis_*: 0 keeps the preset's), "
                                 f"got {getattr(config, name)}")


def _check_sizes(config: ServerConfig) -> None:
    """Tier sizes and the disk tier's segments."""
    for name in ("hbm_bytes", "host_bytes", "redis_bytes", "disk_bytes", "object_bytes"):
        if getattr(config, name) < 0:
            raise InvalidRequest(f"{name} must be >= 0")
    if not config.host_bytes and not config.hbm_bytes:
        raise InvalidRequest("one of host_bytes and hbm_bytes must be > 0: the window "
                             "KV lives only in memory tiers")
    if config.disk_segment_bytes < 1:
        raise InvalidRequest(f"disk_segment_bytes must be > 0, got {config.disk_segment_bytes}")
    if not config.disk_reclaim_dead_fraction > 0 or config.disk_reclaim_interval_s < 0:
        raise InvalidRequest("disk_reclaim_dead_fraction must be > 0 and "
                             "disk_reclaim_interval_s >= 0")


def _check_bounds(config: ServerConfig) -> None:
    """Message and stream bounds, shared-memory leases, retention, replay batches."""
    if config.replay_tokens < 1 or config.max_message_bytes < 1 * MiB:
        raise InvalidRequest("replay_tokens must be >= 1 and max_message_bytes >= 1 MiB")
    if config.max_header_bytes < 64 * KiB:  # and max_message_bytes bounds it too
        raise InvalidRequest(f"max_header_bytes must be >= 64 KiB, got "
                             f"{config.max_header_bytes}")
    for name in ("max_streams", "max_peer_streams", "stream_idle_s",
                 "max_inflight_bytes", "max_tenant_inflight_bytes"):
        if getattr(config, name) <= 0:
            raise InvalidRequest(f"{name} must be > 0, got {getattr(config, name)}")
    if config.shm_lease_s <= 0:
        raise InvalidRequest(f"shm_lease_s must be > 0, got {config.shm_lease_s}")
    for name in ("shm_lease_bytes_per_client", "shm_lease_bytes_total"):
        if getattr(config, name) < 0:
            raise InvalidRequest(f"{name} must be >= 0 (0: no shared memory)")
    if config.retain_ttl_s < 0:
        raise InvalidRequest(f"retain_ttl_s must be >= 0 (0: no TTL), got {config.retain_ttl_s}")
    if config.replay_max_batch < 1:
        raise InvalidRequest(f"replay_max_batch must be >= 1, got {config.replay_max_batch}")


def _check_pairs(config: ServerConfig) -> None:
    for cert, key in (("tls_cert", "tls_key"), ("replay_tls_cert", "replay_tls_key"),
                      ("peer_tls_cert", "peer_tls_key")):
        if bool(getattr(config, cert)) != bool(getattr(config, key)):
            raise InvalidRequest(f"{cert} and {key} go together: set both or neither")
    if config.tls_client_ca and not config.tls_cert:
        raise InvalidRequest("tls_client_ca (mTLS) needs tls_cert and tls_key")
    if config.auth_jwt_audience and not config.auth_jwt_key:
        raise InvalidRequest("auth_jwt_audience needs auth_jwt_key")
    if not config.metrics_host:
        raise InvalidRequest("metrics_host must name an address, e.g. 127.0.0.1")


def _check_fleet(config: ServerConfig) -> None:
    if config.metadata != "shared":
        return
    if not (config.s3_bucket and config.object_bytes):
        raise InvalidRequest("metadata = 'shared' needs an S3 object tier: set s3_bucket "
                             "(and object_bytes > 0), or metadata = 'local'")


def _check_layout_settings(config: ServerConfig) -> None:
    if config.register_layouts not in LAYOUT_POLICIES:
        raise InvalidRequest(f"register_layouts must be one of {LAYOUT_POLICIES}, "
                             f"got {config.register_layouts!r}")
    unknown = set(config.replayers) - set(REPLAYERS[:-1])
    if unknown:
        raise InvalidRequest(f"replayers must be some of {REPLAYERS[:-1]}, got {sorted(unknown)}")
