"""Process lifecycle of the long-running servers (``kvtier serve``, the replay worker): a
graceful stop on signals, and the start-up checks (a free port; for ``kvtier serve`` a
writable data directory and a fleet node's name)."""

from __future__ import annotations

import asyncio
import errno
import signal
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.format.errors import Busy, InvalidRequest

if TYPE_CHECKING:
    from services.server.config import ServerConfig


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT; install it before announcing readiness, so a
    signal sent right after the announcement still stops the process gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


def refuse_if_taken(listen: str, flag: str = "--listen") -> None:
    """Busy when ``listen`` (host:port, set by ``flag``) cannot be bound now. The server
    would fail too, but later (after the store is opened) and gRPC logs its own line."""
    host, _, port = listen.rpartition(":")
    if listen.startswith("unix:") or port == "0":
        return
    try:
        addresses = socket.getaddrinfo(host.strip("[]") or None, int(port),
                                       type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidRequest(f"cannot listen on {listen} ({exc.strerror}): pass another "
                             f"{flag}") from exc
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise Busy(f"cannot listen on {listen} ({exc.strerror}): stop what holds "
                               f"the port or pass another {flag}") from exc
                raise InvalidRequest(f"cannot listen on {listen} ({exc.strerror}): pass "
                                     f"another {flag}") from exc


def check_node_name(config: ServerConfig) -> None:
    """InvalidRequest when a fleet node (shared metadata) would serve under the default
    name of every node that picks its port (host:0)."""
    if config.metadata == "shared" and not config.node_id \
            and not config.listen.startswith("unix:") and config.port == 0:
        raise InvalidRequest("metadata = 'shared' with listen port 0 needs node_id: "
                             "nodes of a fleet must have distinct names")


def prepare_data_dir(path: Path, *, create: bool = True) -> None:
    """Check that files can be made in the data directory (creating it unless ``create``
    is False: then its nearest existing parent is checked), so a wrong one is refused by
    name at start-up rather than by whichever tier touches it first."""
    probe = path
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        else:
            while not probe.exists() and probe.parent != probe:
                probe = probe.parent
            if not probe.is_dir():
                raise NotADirectoryError(str(probe))
        with tempfile.TemporaryFile(dir=probe):
            pass
    except (FileExistsError, NotADirectoryError) as exc:
        raise InvalidRequest(f"data_dir {path} is not a directory (it or a parent is a "
                             "file): choose a directory for data_dir") from exc
    except OSError as exc:
        raise InvalidRequest(f"data_dir {path} cannot be written ({exc.strerror}): fix its "
                             "permissions or choose another data_dir") from exc
