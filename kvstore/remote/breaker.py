"""A circuit breaker per remote dependency (S3, Redis, a replay worker).

    breaker = CircuitBreaker("object", cooldown_s=5.0)
    breaker.check()          # TierUnavailable at once while open
    ... call the dependency within its deadline ...
    breaker.succeeded()      # or breaker.failed(exc)

States: *closed* (calls pass) -> *open* after ``threshold`` consecutive failures (calls
fail fast with ``TierUnavailable``) -> after ``cooldown_s`` *half-open*: one call, the
probe, passes while the others still fail fast; the probe's success closes the breaker,
its failure opens it for another cool-down. A probe whose caller was cancelled
(``cancelled()``) gives its place to the next call; one that never reports is given up
after one more cool-down, so the breaker cannot stick half-open.

A failure is an outage of the dependency (no answer within the deadline, a refused
connection), never the dependency's answer to a request (a missing key, a failed
precondition): callers report those as successes.

Each holder of a breaker exposes it as ``.breaker`` (a tier) or ``.breakers()`` (the
remote replay backend), which the server's metrics export as
``kvtier_breaker_open{dependency}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvstore.format.errors import TierUnavailable

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class CircuitBreaker:
    def __init__(self, dependency: str, *, cooldown_s: float = 5.0, threshold: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if cooldown_s <= 0 or threshold < 1:
            raise ValueError("cooldown_s must be > 0 and threshold >= 1")
        self.dependency, self.cooldown_s, self.threshold = dependency, cooldown_s, threshold
        self.clock = clock
        self._state = CLOSED
        self._failures = 0  # consecutive, while closed
        self._since = 0.0  # when the breaker opened, or when the probe was let through
        self._reason = ""
        self.opened = 0  # times the breaker opened (a counter for tests and logs)

    @property
    def state(self) -> str:
        """closed, open, or half-open (a probe is out, or the next call will be one)."""
        if self._state == OPEN and self.clock() - self._since >= self.cooldown_s:
            return HALF_OPEN
        return self._state

    @property
    def is_open(self) -> bool:
        """Whether calls fail fast now (open, or half-open with its probe out)."""
        return self._state != CLOSED

    def allow(self) -> bool:
        """Whether a call may go to the dependency now (a half-open breaker lets one)."""
        if self._state == CLOSED:
            return True
        if self.clock() - self._since < self.cooldown_s:
            return False
        self._state, self._since = HALF_OPEN, self.clock()  # this call is the probe
        return True

    def check(self) -> None:
        """``TierUnavailable`` (fast, nothing sent) unless a call may go now."""
        if not self.allow():
            left = max(0.0, self.cooldown_s - (self.clock() - self._since))
            raise TierUnavailable(f"{self.dependency} is down (circuit open, next try in "
                                  f"{left:.1f} s): {self._reason}")

    def succeeded(self) -> None:
        if self._state != CLOSED:
            log.warning("%s answered again: circuit closed", self.dependency)
        self._state, self._failures = CLOSED, 0

    def cancelled(self) -> None:
        """A call ended without a verdict (its caller was cancelled): a probe's place is
        given to the next call."""
        if self._state == HALF_OPEN:
            self._state, self._since = OPEN, self.clock() - self.cooldown_s

    def failed(self, reason: object) -> None:
        self._reason = str(reason)
        self._failures += 1
        if self._state == HALF_OPEN or self._failures >= self.threshold:
            if self._state == CLOSED:
                self.opened += 1
                log.warning("%s unavailable, circuit open for %.1f s: %s", self.dependency,
                            self.cooldown_s, reason)
            self._state, self._since = OPEN, self.clock()


def tripped(holder: object) -> bool:
    """Whether ``holder`` (a tier) has a circuit breaker and it is open."""
    breaker = getattr(holder, "breaker", None)
    return breaker is not None and breaker.is_open
