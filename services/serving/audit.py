"""The audit trail: one JSON line per event in ``audit_log`` (when set), and a Prometheus
counter per kind (``kvtier_audit_events_total{kind=...}``).

Kinds: ``auth_failure`` (a missing, unknown or expired credential), ``permission_denied``
(a role or tenant the credential does not cover), ``delete`` (every Delete, whoever asked),
``layout`` (every RegisterLayout, whoever asked; the reason names the layout), ``admin``
(every other call of an admin) and ``plaintext`` (a connection that spoke plaintext to a
TLS port, at most one line per client host a minute: ``services.serving.tls_front``; no
method, identity or target: no call was read). A line holds the time (UTC, ISO 8601), the
kind, the identity (tenant and role, or role "anonymous"), the method, the peer, the
result (a status code name), for failures the reason, and ``target``: the tenant the
request named, when it names one (a denial says whose sessions were asked for); never a
token (a credential is named by a prefix of its SHA-256 at most). The file is the
owner's only (0600), made so and tightened at start with a warning when it was looser.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import stat
import threading
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)
KINDS = ("auth_failure", "permission_denied", "delete", "layout", "admin", "plaintext")


class Caller(Protocol):
    """Who made a call (``services.serving.auth.Identity``)."""

    @property
    def tenant(self) -> str: ...

    @property
    def role(self) -> str: ...


class AuditLog:
    def __init__(self, path: str = "", registry: CollectorRegistry | None = None) -> None:
        # Held open for the server's life; line-buffered: each event is one write, in order.
        self._file = _open_private(path) if path else None
        self._lock = threading.Lock()
        self.events = Counter("kvtier_audit_events_total", "Audit events by kind", ["kind"],
                              registry=registry or CollectorRegistry())
        for kind in KINDS:
            self.events.labels(kind)  # every kind exported from the start, at 0

    def record(self, kind: str, identity: Caller | None, method: str, peer: str,
               result: str, reason: str = "", target: str = "") -> None:
        self.events.labels(kind).inc()
        if self._file is None:
            return
        line = {"time": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
                "kind": kind,
                "tenant": identity.tenant if identity is not None else "",
                "role": identity.role if identity is not None else "anonymous",
                "method": method, "peer": peer, "result": result}
        if target:
            line["target"] = target
        if reason:
            line["reason"] = reason
        try:
            with self._lock:
                self._file.write(json.dumps(line) + "\n")
        except OSError as exc:  # a full disk must not fail the call it records
            log.error("cannot write the audit log: %s (%s)", exc, line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _open_private(path: str):
    """``path`` opened for appending, created 0600; an existing file open to others is
    made 0600 with a warning (it names who called and what was denied)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    mode = stat.S_IMODE(os.fstat(descriptor).st_mode)
    if mode & 0o077:
        try:
            os.fchmod(descriptor, 0o600)
            log.warning("audit_log %s was readable by others (mode %o): made 600", path, mode)
        except PermissionError:  # another user's file: say so only
            log.warning("audit_log %s is readable by others (mode %o) and not ours to "
                        "change: make it 600", path, mode)
    return open(descriptor, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
