"""One circuit breaker for an engine's calls to kvtier: after ``threshold`` consecutive
failures (an outage: no answer within the deadline, a refused connection) calls fail
fast for ``cooldown_s``, then one call, the probe, goes through; its success closes the
breaker. An engine thread that would wait on a server known to be down answers a miss at
once instead.

Engine threads call it from several threads at once, so its state is under a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Breaker:
    def __init__(self, *, threshold: int = 3, cooldown_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1 or cooldown_s <= 0:
            raise ValueError("threshold must be >= 1 and cooldown_s > 0")
        self.threshold, self.cooldown_s, self.clock = threshold, cooldown_s, clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None  # None: closed
        self._probing = False
        self.opened = 0  # times it opened

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

    def failed(self) -> None:
        with self._lock:
            self._failures += 1
            if self._probing:
                self._opened_at, self._probing = self.clock(), False
            elif self._opened_at is None and self._failures >= self.threshold:
                self._opened_at = self.clock()
                self.opened += 1
