"""Small pieces every tier implementation shares: value and key checks, and outage
bookkeeping for tiers behind a network (Redis, S3)."""

from __future__ import annotations

import logging
import math
import time
from urllib.parse import urlsplit

from kvstore.format.errors import InvalidRequest


def as_byte_view(value: object) -> memoryview:
    """A flat, byte-format view of a bytes-like value, or ``InvalidRequest``."""
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError as exc:
        raise InvalidRequest(f"value must be bytes-like, got {type(value).__name__}") from exc
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise InvalidRequest("value must be a C-contiguous buffer")
    return view.cast("B")


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidRequest(f"tier keys are non-empty strings, got {key!r}")
    return key


class Availability:
    """Whether a remote medium answered its last call, with rate-limited logging.

    A partial outage (one cluster node down) makes calls fail and succeed in turn; the
    log gets one error per ``log_interval_s`` (with the failure count) and one recovery
    line per logged error, not a line per call."""

    def __init__(self, logger: logging.Logger, what: str, log_interval_s: float = 10.0
                 ) -> None:
        self.logger, self.what, self.log_interval_s = logger, what, log_interval_s
        self.available = True
        self.failures = 0
        self._logged_at = -math.inf
        self._recovery_unlogged = False

    def failed(self, operation: str, exc: BaseException) -> None:
        self.failures += 1
        self.available = False
        now = time.monotonic()
        if now - self._logged_at >= self.log_interval_s:
            self.logger.error("%s unavailable (%s): %r [%d failed calls so far]",
                              self.what, operation, exc, self.failures)
            self._logged_at = now
            self._recovery_unlogged = True

    def succeeded(self) -> None:
        if not self.available:
            self.available = True
            if self._recovery_unlogged:
                self.logger.warning("%s available again", self.what)
                self._recovery_unlogged = False


def without_password(url: str) -> str:
    """``url`` with a password it carries (``redis://:secret@host``) shown as ``<secret>``:
    the form of a URL that may be logged or put in an error."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{user.partition(':')[0]}:<secret>@{host}").geturl()
