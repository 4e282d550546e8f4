"""An engine's link to kvtier and the circuit breaker over it, shared by the vLLM
connector and the SGLang storage backend: an engine thread that would wait on a server
known to be down answers a miss at once instead, and the engine serves by recomputing.

``Breaker``: closed (calls go through) until ``threshold`` consecutive failures (an
outage: no answer within the deadline, a refused connection), then open (calls fail
fast) until a success closes it. That success is a probe: the first call past
``cooldown_s`` (``allow``, as SGLang's storage calls it), or the owner's own on a timer
(``Link``, as the vLLM connector uses it).

``Link``: a client to one kvtier server, the layouts it must know, and a breaker over
it that starts open: it is *up* once its layouts are registered and while fewer than
``failures`` calls in a row have failed. While it is down a background thread tries the
server again every ``probe_interval_s`` by registering the layouts (idempotent): the first
registration at start, the same after an outage or a server restart. Nothing here ever
blocks the caller: registration and probes run on the link's own thread, and ``up`` is a
flag read.

Engine threads call both from several threads at once, so a breaker's state is under a
lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.format.layout import LayoutSpec
from kvtier.sync import Client


class Breaker:
    def __init__(self, *, threshold: int = 3, cooldown_s: float = 2.0,
                 start_open: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``start_open``: nothing is known to work until a first success."""
        if threshold < 1 or cooldown_s <= 0:
            raise ValueError(f"a breaker needs threshold >= 1 and cooldown_s > 0, got "
                             f"{threshold} and {cooldown_s}")
        self.threshold, self.cooldown_s, self.clock = threshold, cooldown_s, clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = clock() if start_open else None  # None: closed
        self._probing = False
        self.opened = 0  # times a run of failures opened it

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._opened_at is not None

    def allow(self) -> bool:
        """Whether a call may go now: closed, or open past its cool-down with no probe out
        (this call is the probe)."""
        with self._lock:
            if self._opened_at is None:
                return True
            if self.clock() - self._opened_at < self.cooldown_s:
                return False
            # this call is the probe; the others wait another cool-down, after which a
            # probe that never reported gives its place to the next call
            self._probing, self._opened_at = True, self.clock()
            return True

    def succeeded(self) -> None:
        with self._lock:
            self._failures, self._opened_at, self._probing = 0, None, False

    def failed(self) -> bool:
        """Count a failure; whether this one opened the breaker (a failed probe keeps it
        open for another cool-down, which is not opening it)."""
        with self._lock:
            self._failures += 1
            if self._probing:
                self._opened_at, self._probing = self.clock(), False
            elif self._opened_at is None and self._failures >= self.threshold:
                self._opened_at = self.clock()
                self.opened += 1
                return True
            return False


class Link:
    """A client to one kvtier server, the layouts it must know, and the breaker over it."""

    def __init__(self, client: Client, layouts: Sequence[LayoutSpec], *, server: str,
                 failures: int, probe_interval_s: float, logger: logging.Logger) -> None:
        self.client = client
        self.layouts = list(layouts)
        self.server = server
        # probes run on this link's timer, never through allow(): the cool-down is unused
        self.breaker = Breaker(threshold=failures, cooldown_s=probe_interval_s,
                               start_open=True)
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
        return not self.breaker.is_open

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
            if self.breaker.is_open:
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
