"""The flags naming the server a command talks to and how: ``--server HOST:PORT``, by
default ``$KVTIER_SERVER`` (``$KVTIER_TARGET``, its old name, still read) or the local
default; ``--tls-ca`` (TLS), ``--tls-cert`` with ``--tls-key`` (mTLS), ``--token-file``
(else ``$KVTIER_TOKEN``) for a server that authenticates (README "Security")."""

from __future__ import annotations

import argparse
import os
from typing import TypedDict

from kvstore.format.errors import KVTierError, TierUnavailable
from kvtier.channel import token_from_file

DEFAULT_SERVER = "127.0.0.1:50051"
ENV_VARS = ("KVTIER_SERVER", "KVTIER_TARGET")
TOKEN_ENV = "KVTIER_TOKEN"


def server_from_env() -> str | None:
    return next((os.environ[name] for name in ENV_VARS if os.environ.get(name)), None)


def add_server_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", metavar="HOST:PORT",
                        default=server_from_env() or DEFAULT_SERVER,
                        help="kvtier server address (default: $KVTIER_SERVER or %(default)s)")
    add_credential_arguments(parser)


def add_credential_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", metavar="PEM", help="use TLS; the CA of the server's "
                        "certificate")
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate (mTLS)")
    parser.add_argument("--tls-key", metavar="PEM", help="its private key")
    parser.add_argument("--token-file", metavar="FILE",
                        help=f"bearer token to send (default: ${TOKEN_ENV})")


class ClientOptions(TypedDict):
    """The credential keyword arguments of ``kvtier.Client``."""

    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    token: str | None


def client_options(args: argparse.Namespace) -> ClientOptions:
    """The ``kvtier.Client`` keyword arguments the credential flags ask for."""
    token = (token_from_file("--token-file", args.token_file) if args.token_file
             else os.environ.get(TOKEN_ENV)) or None
    return {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key,
            "token": token}


def failure(command: str, server: str, exc: KVTierError) -> str:
    """The one line a command prints when its call failed; unavailable: what to check
    (unless the client named a TLS mismatch, ``kvtier.channel.tls_mismatch``)."""
    line = f"kvtier {command}: {exc}"
    if isinstance(exc, TierUnavailable) and not str(exc).startswith("TLS:"):
        line += (f" (is `kvtier serve` running at {server}? pass --server HOST:PORT or set "
                 "KVTIER_SERVER)")
    return line
