"""The connector's view of kvtier's health: one ``Link`` per connector instance, whose
``Breaker`` fails fast while kvtier is down.

A link is *up* once its layouts are registered with the server and while fewer than
``breaker_failures`` calls in a row have failed or timed out. While it is down every lookup
is a miss at once and every save is skipped (the engine serves by recomputing), and a
background thread tries the server again every ``probe_interval_s`` by registering the
layouts (idempotent): the first registration at start, the same after an outage or a server
restart. Nothing here ever blocks the caller: registration and probes run on the link's
own thread, and ``up`` is a flag read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvstore.format.layout import LayoutSpec
from kvtier.sync import Client


class Breaker:
    """Closed (calls go through) until ``failures`` consecutive failures, then open (calls
    fail fast) until a success closes it again: the link's probe, on a timer."""

    def __init__(self, failures: int) -> None:
        if failures < 1:
            raise ValueError(f"a breaker needs failures >= 1, got {failures}")
        self.failures = failures
        self._lock = threading.Lock()
        self._in_a_row = 0
        self._open = True  # until the first success: nothing is known to work

    @property
    def open(self) -> bool:
        return self._open

    def succeeded(self) -> None:
        with self._lock:
            self._in_a_row = 0
            self._open = False

    def failed(self) -> bool:
        """Count a failure; whether this one opened the breaker."""
        with self._lock:
            self._in_a_row += 1
            opened = not self._open and self._in_a_row >= self.failures
            if opened:
                self._open = True
            return opened


class Link:
    """A client to one kvtier server, the layouts it must know, and the breaker over it."""

    def __init__(self, client: Client, layouts: Sequence[LayoutSpec], *, server: str,
                 failures: int, probe_interval_s: float, logger: logging.Logger) -> None:
        self.client = client
        self.layouts = list(layouts)
        self.server = server
        self.breaker = Breaker(failures)
        self.probe_interval_s = probe_interval_s
        self._logger = logger
        self._wake = threading.Event()
        self._closed = False
        self._said_down = False
        self._thread = threading.Thread(target=self._probe_loop, daemon=True,
                                        name="kvtier-link")
        self._thread.start()

    @property
    def up(self) -> bool:
        return not self.breaker.open

    def succeeded(self) -> None:
        self.breaker.succeeded()

    def failed(self, what: str, exc: BaseException) -> None:
        """A call failed or timed out: counted; the breaker may open (logged once)."""
        if self.breaker.failed():
            self._logger.warning("kvtier unreachable at %s (%s: %s): serving by recompute, "
                                 "retrying every %gs", self.server, what, exc,
                                 self.probe_interval_s)
            self._said_down = True
            self._wake.set()

    def _probe_loop(self) -> None:
        while not self._closed:
            if self.breaker.open:
                self._probe()
            self._wake.wait(self.probe_interval_s)
            self._wake.clear()

    def _probe(self) -> None:
        started = time.monotonic()
        try:
            for spec in self.layouts:
                self.client.register_layout(spec)
        except Exception as exc:  # down, refusing, or anything else: still recomputing
            if not self._said_down:
                self._logger.warning("kvtier unreachable at %s: serving by recompute, "
                                     "retrying every %gs (%s)", self.server,
                                     self.probe_interval_s, exc)
                self._said_down = True
            return
        self.breaker.succeeded()
        self._said_down = False
        self._logger.info("kvtier connected to %s: layouts %s registered in %.0f ms",
                          self.server, [s.name for s in self.layouts],
                          (time.monotonic() - started) * 1000)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=1)  # a probe stuck on a hung server: a daemon thread
        self.client.close()
