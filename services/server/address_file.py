"""The address a serving server records in its data directory, for tools on the same host.

``kvtier compact`` beside a live server changes sessions through the server's RPCs and
finds it through ``{data_dir}/server.addr`` (``services.cli.compact_remote``): one line,
a connectable ``host:port``. A wildcard listen address (0.0.0.0, [::]) is recorded as
loopback, since nothing can connect to a wildcard.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SERVER_ADDRESS_FILE = "server.addr"  # one line, host:port, written by a serving server
WILDCARD_HOSTS = ("", "0.0.0.0", "[::]", "::", "*")


def connectable(listen: str, port: int) -> str:
    """``host:port`` a local client can dial for a server bound to ``listen``."""
    host = listen.rpartition(":")[0]
    return f"{'127.0.0.1' if host in WILDCARD_HOSTS else host}:{port}"


def record(data_dir: Path, address: str) -> Path:
    """Write ``address`` to ``data_dir/server.addr`` atomically: a reader sees the old
    file or the whole new one, never a partial line."""
    path = data_dir / SERVER_ADDRESS_FILE
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temp, "w") as handle:
        handle.write(address + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)
    directory = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)
    return path


def recorded_address(data_dir: Path) -> str | None:
    """The address a live server recorded in ``data_dir``, if it did."""
    try:
        address = (data_dir / SERVER_ADDRESS_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return address or None


def forget(path: Path, address: str) -> None:
    """Remove the record if it is still ours (another server may have replaced it)."""
    with contextlib.suppress(FileNotFoundError):
        if path.read_text().strip() == address:
            path.unlink()
