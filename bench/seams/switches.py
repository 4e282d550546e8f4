"""The feature switches a simulation crosses, and the server config each combination is.

Five switches, so 32 combinations, named by the switches on (``enc+quota+tls``;
``plain`` with none):

- ``enc``: encryption at rest, a key file (``encryption_key_file``) of one key;
- ``quota``: ``[quota.default]`` of ``SESSIONS`` sessions and ``DURABLE_BYTES``;
- ``ret``: retention: unreferenced chunks kept as cache with a short TTL
  (``RETAIN_TTL_S``), and some spills carry a session TTL (``SESSION_TTL_S``); prefix
  chunks (WriteChunks) need it;
- ``shared``: shared metadata (``metadata = "shared"``) in a moto S3 bucket of its own,
  with the Redis tier beside it;
- ``tls``: TLS with the development certificates and bearer tokens bound to tenants.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from itertools import product
from pathlib import Path

SWITCHES = ("enc", "quota", "ret", "shared", "tls")
SESSIONS = 6  # per tenant, with quota on
DURABLE_BYTES = 256 << 10
SESSION_TTL_S = 4.0
# Past a restart (a few seconds), so prefix chunks written just before one are judged
# after it (bench.seams.prefix); short enough that unreferenced chunks still expire
# within a combination's run.
RETAIN_TTL_S = 12.0


@dataclass(frozen=True)
class Combination:
    enc: bool
    quota: bool
    ret: bool
    shared: bool
    tls: bool

    @property
    def name(self) -> str:
        on = [s for s in SWITCHES if getattr(self, s)]
        return "+".join(on) or "plain"

    @property
    def slug(self) -> str:
        return self.name.replace("+", "-")


def all_combinations() -> list[Combination]:
    return [Combination(*bits) for bits in product((False, True), repeat=len(SWITCHES))]


def parse_combinations(text: str) -> list[Combination]:
    """``all`` or a comma-separated list of names (``plain,enc+tls``)."""
    every = {c.name: c for c in all_combinations()}
    if text == "all":
        return list(every.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in every]
    if unknown:
        raise ValueError(f"unknown combinations {unknown}; names join {SWITCHES} with '+', "
                         "or 'plain'")
    return [every[n] for n in names]


def write_config(combo: Combination, root: Path, data_dir: Path, *, redis_url: str,
                 s3_endpoint: str, bucket: str, creds_root: Path | None,
                 shared: bool | None = None, replay_worker: str = "") -> Path:
    """The TOML ``kvtier serve --config`` reads for ``combo`` (``shared`` overrides the
    switch: a migrated directory served shared; ``replay_worker``: host:port of a
    ``kvtier replay-worker`` that rebuilds every window); its path."""
    shared = combo.shared if shared is None else shared
    lines = ['preset = "test"', 'listen = "127.0.0.1:0"', f'data_dir = "{data_dir}"',
             'disk_bytes = "1GiB"',  # above the tmpfs: the medium fills first
             'disk_segment_bytes = "256KiB"', "disk_reclaim_interval_s = 1.0",
             "grace_s = 5.0", 'register_layouts = "auto"',
             'log_format = "json"', "slow_request_s = 2.0"]  # read by engine.read_server_log
    if combo.enc:
        keys = root / "keys.toml"
        material = base64.b64encode(hashlib.sha256(combo.name.encode()).digest()).decode()
        if not keys.exists():  # a later config keeps the keyring an operator rotated
            keys.write_text(f'[[key]]\nid = "seams"\nmaterial = "{material}"\n'
                            'current = true\n')
            keys.chmod(0o600)
        lines.append(f'encryption_key_file = "{keys}"')
    if combo.ret:
        lines += ["retain_unreferenced = true", f"retain_ttl_s = {RETAIN_TTL_S}"]
    else:
        lines.append("retain_unreferenced = false")
    if shared:
        lines += ['metadata = "shared"', f'node_id = "seams-{combo.slug}"',
                  f's3_endpoint = "{s3_endpoint}"', f's3_bucket = "{bucket}"',
                  's3_region = "us-east-1"', f'redis_url = "{redis_url}"',
                  f'redis_prefix = "seams:{combo.slug}:"', 'redis_bytes = "64MiB"']
    if combo.tls and creds_root is not None:
        lines += [f'tls_cert = "{creds_root / "server.pem"}"',
                  f'tls_key = "{creds_root / "server-key.pem"}"',
                  f'auth_tokens_file = "{creds_root / "tokens.toml"}"',
                  f'audit_log = "{creds_root / "audit.jsonl"}"']
        if shared:  # a drain hands its windows to peers with the peer token
            lines += [f'peer_tls_ca = "{creds_root / "ca.pem"}"',
                      f'peer_token_file = "{creds_root / "peer.token"}"']
    if replay_worker:
        lines += ['replay = "remote"', f'replay_workers = ["{replay_worker}"]']
    if combo.quota:
        lines += ["[quota.default]", f"sessions = {SESSIONS}",
                  f"durable_bytes = {DURABLE_BYTES}"]
    path = root / ("serve-shared.toml" if shared and not combo.shared else "serve.toml")
    path.write_text("\n".join(lines) + "\n")
    return path
