"""Process lifecycle of the long-running servers (``kvtier serve``, the replay worker): a
graceful stop on signals, and the free-port check at start."""

from __future__ import annotations

import asyncio
import errno
import signal
import socket

from kvstore.format.errors import Busy, InvalidRequest


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
