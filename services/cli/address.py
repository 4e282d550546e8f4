"""The one flag naming the server a command talks to: ``--server HOST:PORT``, by default
``$KVTIER_SERVER`` (``$KVTIER_TARGET``, its old name, still read) or the local default."""

from __future__ import annotations

import argparse
import os

from kvstore.errors import KVTierError, TierUnavailable

DEFAULT_SERVER = "127.0.0.1:50051"
ENV_VARS = ("KVTIER_SERVER", "KVTIER_TARGET")


def server_from_env() -> str | None:
    return next((os.environ[name] for name in ENV_VARS if os.environ.get(name)), None)


def add_server_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", metavar="HOST:PORT",
                        default=server_from_env() or DEFAULT_SERVER,
                        help="kvtier server address (default: $KVTIER_SERVER or %(default)s)")


def failure(command: str, server: str, exc: KVTierError) -> str:
    """The one line a command prints when its call failed; unavailable: what to check."""
    line = f"kvtier {command}: {exc}"
    if isinstance(exc, TierUnavailable):
        line += (f" (is `kvtier serve` running at {server}? pass --server HOST:PORT or set "
                 "KVTIER_SERVER)")
    return line
