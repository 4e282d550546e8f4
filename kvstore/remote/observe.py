"""Where kvstore reports the timings and outcomes of its remote calls and of the fleet's
protocol, for the service to export (``services.server.metrics``); kvstore itself never
imports a metrics library.

Each holder has an ``observer`` attribute, ``IGNORE`` until the service sets its own:
``BlockingCalls`` (S3: the object tier and the fleet's bucket), ``RedisTier``,
``SharedMetaStore`` (manifest compare-and-swap) and its ``SpillGate`` (epoch-gate waits);
``kvstore.fleet.gc.collect`` reports to the observer of the store it sweeps.

Labels stay bounded: ``op`` is a call's short name (``get``, ``put``, ``delete``, ``list``,
``head``, ``get_body``; Redis: ``set``, ``get``, ``del``...), ``kind`` one of ``KINDS``.
"""

from __future__ import annotations

KINDS = ("timeout", "throttled", "unavailable", "other")
CAS_RESULTS = ("won", "conflict", "error")
GC_RESULTS = ("ok", "error")


def op_name(what: str) -> str:
    """The ``op`` label of a call named ``what`` ("GET body" -> "get_body")."""
    return what.lower().replace(" ", "_").replace("/", "_")


class Observer:
    """The hooks; this base ignores every report."""

    def request(self, dependency: str, op: str, seconds: float) -> None:
        """A call to ``dependency`` ("object", "redis") ended after ``seconds``."""

    def error(self, dependency: str, op: str, kind: str) -> None:
        """A call failed: ``kind`` in ``KINDS`` (never an answer such as a missing key or
        a failed precondition)."""

    def cas(self, result: str) -> None:
        """A conditional write of a shared manifest: ``result`` in ``CAS_RESULTS``."""

    def gate_wait(self, seconds: float) -> None:
        """A spill's time at the garbage-collection epoch gate before its commit."""

    def gc_run(self, result: str, deleted: int) -> None:
        """A sweep of the fleet's bucket ended (``result`` in ``GC_RESULTS``)."""


IGNORE = Observer()
