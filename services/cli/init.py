"""``kvtier init``: a working server setup in a new directory, from the installed wheel
alone (no checkout).

    kvtier init DIR [--secure] [--force] [--listen HOST:PORT] [--metrics-port N]

writes ``DIR/kvtier.toml``: a server listening on loopback (``--listen``, default
127.0.0.1:50051) with its data in ``DIR/data``, host RAM and disk tiers, durable acks and
metrics on loopback (``--metrics-port``, 0 for none). With ``--secure`` also what
``kvtier certs`` and ``kvtier keygen`` write, into ``DIR/tls/`` and ``DIR/keyring.toml``:
a development CA and a server certificate (for loopback and each ``--name``), bearer
tokens (``admin``, ``acme``, ``beta``, ``replay``, ``peer``: ``DIR/tls/*.token``) and their
``tokens.toml``, an encryption key; the config then turns on TLS (the metrics endpoint
too: HTTPS), tokens, encryption at rest, a default quota and an audit log. Every path in
the config is absolute, so ``kvtier serve --config DIR/kvtier.toml`` runs from anywhere.

It also copies the deploy files the wheel ships (package data of ``services``, the
repository's ``deploy/``) into ``DIR/deploy/``: Prometheus' scrape config and alert rules,
Alertmanager's config, the Grafana dashboard and its provisioning, ``secure.toml`` and the
annotated ``kvtier.example.toml``.

Files are 0600 and directories 0700 (the config names the data and key files; the data
directory holds tenants' sessions). A DIR that exists and is not empty is refused unless
``--force`` (files of the same names are then replaced, a keyring never: values sealed
under it would be lost). Prints the ``kvtier serve`` line to run, and with ``--secure``
a client line. Exit status 0, or 2 refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from pathlib import Path

from kvstore.format.errors import InvalidRequest
from services.serving.tls import is_loopback

# The deploy files the wheel ships: paths under services/deploy (the repository's deploy/).
DEPLOY_FILES = ("alerts.yml", "prometheus.yml", "alertmanager.yml", "secure.toml",
                "kvtier.example.toml", "grafana/dashboards/kvtier.json",
                "grafana/provisioning/dashboards/kvtier.yml",
                "grafana/provisioning/datasources/prometheus.yml")
DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_METRICS_PORT = 9100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="where to write the setup (created)")
    parser.add_argument("--secure", action="store_true", help="also TLS certificates, "
                        "tokens and an encryption keyring, and a config that uses them")
    parser.add_argument("--force", action="store_true",
                        help="write into a DIR that is not empty, replacing files of the same "
                        "names (never a keyring)")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help="the gRPC address (default %(default)s: this machine only)")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                        help="Prometheus metrics on loopback at this port (0: none; default "
                        "%(default)s)")
    parser.add_argument("--name", action="append", default=[], metavar="HOST",
                        help="--secure: also issue the server certificate for this name")


def deploy_file(name: str) -> bytes:
    """A shipped deploy file (``DEPLOY_FILES``) as installed."""
    return resources.files("services").joinpath("deploy", name).read_bytes()


def config_text(root: Path, listen: str, metrics_port: int, secure: bool) -> str:
    """The TOML of ``DIR/kvtier.toml`` (absolute paths under ``root``)."""

    def path(*parts: str) -> str:
        return json.dumps(str(root.joinpath(*parts)))

    lines = ["# Written by `kvtier init`. Every key, annotated:",
             f"#   {root / 'deploy' / 'kvtier.example.toml'}",
             f"# Check: kvtier serve --config {root / 'kvtier.toml'} --print-config",
             "# Listening on loopback: to serve other machines, set listen = \"0.0.0.0:50051\"",
             "# (or one of this host's addresses) with TLS and tokens on (`kvtier init --secure`",
             "# writes them); `kvtier serve` refuses it otherwise.",
             f"listen = {json.dumps(listen)}",
             f"data_dir = {path('data')}",
             'default_ack = "durable"            # a spill returns once it is on disk',
             f"metrics_port = {metrics_port}",
             'metrics_host = "127.0.0.1"']
    if secure:
        lines += ["",
                  "# TLS (gRPC and the metrics endpoint), bearer tokens, encryption at rest.",
                  f"tls_cert = {path('tls', 'server.pem')}",
                  f"tls_key = {path('tls', 'server-key.pem')}",
                  f"auth_tokens_file = {path('tls', 'tokens.toml')}",
                  f"audit_log = {path('audit.jsonl')}",
                  "# how this node reaches fleet peers when it drains (role \"peer\")",
                  f"peer_tls_ca = {path('tls', 'ca.pem')}",
                  f"peer_token_file = {path('tls', 'peer.token')}",
                  f"encryption_key_file = {path('keyring.toml')}",
                  "",
                  "[quota.default]",
                  "sessions = 1000",
                  'durable_bytes = "20GiB"',
                  'memory_bytes = "512MiB"']
    return "\n".join(lines) + "\n"


def _refusal(args: argparse.Namespace) -> str | None:
    if args.directory.startswith("-"):
        return f"DIR {args.directory!r} starts with '-': name a directory (./{args.directory})"
    root = Path(args.directory)
    if root.exists() and not root.is_dir():
        return f"{args.directory} exists and is not a directory"
    if root.is_dir() and any(root.iterdir()) and not args.force:
        return f"{args.directory} is not empty: pass --force to write into it"
    host, _, port = args.listen.rpartition(":")
    if not host.strip("[]") or not port.isdigit():
        return f"--listen {args.listen!r} is not HOST:PORT"
    if not is_loopback(args.listen) and not args.secure:
        return (f"--listen {args.listen} reaches other machines: add --secure (TLS and "
                "tokens), or listen on loopback")
    if not 0 <= args.metrics_port < 65536:
        return f"--metrics-port {args.metrics_port} is not a port"
    return None


def _private(path: Path, data: bytes) -> None:
    """Write ``path`` 0600 from its creation (replacing one of the same name)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = path.with_name(path.name + ".tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(temp, 0o600)
    os.replace(temp, path)


def _lock_down(root: Path) -> None:
    """What init wrote private: ``root``, its ``data`` directory, and every directory
    0700 and file 0600 of the trees it wrote (``deploy``, ``tls``); nothing else a
    ``--force`` DIR holds is touched."""
    for path in (root, root / "data"):
        os.chmod(path, 0o700)
    for tree in (root / "deploy", root / "tls"):
        for where, _, files in os.walk(tree):
            os.chmod(where, 0o700)
            for name in files:
                os.chmod(Path(where) / name, 0o600)


def write(args: argparse.Namespace) -> Path:
    """Write the setup; the config's path."""
    from services.cli.keygen import write_keyring
    from services.server.config_load import load_config
    from services.server.devcerts import write_dev_set

    root = Path(args.directory).resolve()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in DEPLOY_FILES:
        _private(root / "deploy" / name, deploy_file(name))
    if args.secure:
        write_dev_set(root / "tls", tuple(args.name))
        if not (root / "keyring.toml").exists():  # --force never replaces a keyring
            write_keyring(root / "keyring.toml", "init-key")
    config = root / "kvtier.toml"
    _private(config, config_text(root, args.listen, args.metrics_port, args.secure).encode())
    (root / "data").mkdir(mode=0o700, exist_ok=True)
    _lock_down(root)
    load_config(config, env={})  # refuses what serve would: never leave a config it refuses
    return config


def run(args: argparse.Namespace) -> int:
    problem = _refusal(args)
    if problem:
        print(f"kvtier init: {problem}", file=sys.stderr)
        return 2
    try:
        config = write(args)
    except OSError as exc:
        print(f"kvtier init: cannot write {args.directory}: {exc.strerror}", file=sys.stderr)
        return 2
    except InvalidRequest as exc:
        print(f"kvtier init: {exc}", file=sys.stderr)
        return 2
    root = config.parent
    print(f"kvtier init: wrote {config}, {root / 'deploy'}/"
          + (f", certificates and tokens in {root / 'tls'}, a keyring" if args.secure else ""))
    print(f"run:  kvtier serve --config {config}")
    if args.secure:
        print(f"then: kvtier stat --server {args.listen} --tls-ca {root / 'tls' / 'ca.pem'} "
              f"--token-file {root / 'tls' / 'admin.token'}")
    return 0
