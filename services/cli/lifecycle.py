"""Process lifecycle shared by the long-running commands (``serve``, ``replay-worker``);
their start-up port check is ``services.server.preflight.refuse_if_taken``."""

from __future__ import annotations

import asyncio
import signal


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT; install it before announcing readiness, so a
    signal sent right after the announcement still stops the process gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop
