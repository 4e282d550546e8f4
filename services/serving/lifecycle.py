"""Process lifecycle of the long-running servers (``kvtier serve``, the replay worker): a
graceful stop on signals, a reload on SIGHUP, the free-port check at start, and the end of
their background tasks (``end_task``).

``kvtier serve`` records its process id in ``{data_dir}/server.pid`` while it serves, and
the outcome of each reload in ``{data_dir}/server.reload`` (one line: a count, ``ok`` or
``refused``, and what was done or why not), so ``kvtier reload --data-dir DIR`` can signal
it and report what happened."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from kvstore.format.errors import Busy, InvalidRequest


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT; install it before announcing readiness, so a
    signal sent right after the announcement still stops the process gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


PID_FILE = "server.pid"
RELOAD_FILE = "server.reload"


async def end_task(task: asyncio.Task | None) -> None:
    """Cancel ``task`` and wait until it has ended. Python 3.11's ``asyncio.wait_for`` can
    swallow a cancellation that races the result it waits for, and a loop task would then
    run on forever: it is cancelled again until it ends."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled():
        task.exception()  # retrieved: a task that failed is not logged as never retrieved


def reload_on_hangup(reload: Callable[[], None]) -> None:
    """Run ``reload`` on the event loop at each SIGHUP (whose default ends the process)."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


def record_pid(data_dir: Path) -> Path:
    path = data_dir / PID_FILE
    path.write_text(f"{os.getpid()}\n")
    return path


def forget_pid(path: Path) -> None:
    """Remove the pid file if it is still this process's."""
    with contextlib.suppress(OSError, ValueError):
        if int(path.read_text()) == os.getpid():
            path.unlink()


def record_reload(data_dir: Path, count: int, ok: bool, line: str) -> None:
    """The outcome of reload number ``count``, written whole (a new file renamed over)."""
    path = data_dir / RELOAD_FILE
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(f"{count} {'ok' if ok else 'refused'} {line}\n")
    os.replace(temp, path)


def read_reload(data_dir: Path) -> tuple[int, str] | None:
    """(count, the rest of the line) of the last reload recorded, if any."""
    try:
        count, _, rest = (data_dir / RELOAD_FILE).read_text().strip().partition(" ")
        return int(count), rest
    except (OSError, ValueError):
        return None


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
