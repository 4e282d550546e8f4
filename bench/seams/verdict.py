"""Findings and the judgement of each reply against the reference model.

Failure keys (each a count; a run is clean when all are 0):

- ``wrong``: a reply that holds other data than the model (tensors, tokens, generation,
  a window other than the one spilled, a deleted session restored, a window shorter than
  the replay asked for);
- ``lost``: a session the model says must exist answered SessionNotFound or DataLoss;
- ``quota_overshoot``: a tenant holds more sessions (or durable bytes) than its quota;
- ``internal``: INTERNAL or UNKNOWN (``ServerError``), or a client-side crash;
- ``unexpected``: any other error the state does not document (TierFull off a full
  medium, UNAVAILABLE from a live server, a tool's failure, a refused combination);
- ``stalls_over_50ms``: event-loop ticks over 50 ms late, from the server's metric.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from kvstore.format.errors import (
    CodecError,
    DataLoss,
    KVTierError,
    NotFound,
    ServerError,
)

KEYS = ("wrong", "lost", "quota_overshoot", "internal", "unexpected", "stalls_over_50ms")
SHOWN = 50  # findings kept with details; the counts go on


@dataclass
class Finding:
    kind: str  # one of KEYS
    combination: str
    seed: int
    step: int
    op: str
    session: str
    expected: str
    got: str


class Ledger:
    """Counts per failure key and the first ``SHOWN`` findings, for one run."""

    def __init__(self, seed: int, log) -> None:
        self.seed = seed
        self.log = log
        self.counts = dict.fromkeys(KEYS, 0)
        self.findings: list[Finding] = []
        self.by_combination: dict[str, dict[str, int]] = {}

    def add(self, kind: str, combination: str, step: int, op: str, session: str,
            expected: str, got: str, count: int = 1) -> None:
        """One finding (``count``: of that many failures, e.g. stalls)."""
        self.counts[kind] += count
        self.by_combination.setdefault(combination, dict.fromkeys(KEYS, 0))[kind] += count
        finding = Finding(kind, combination, self.seed, step, op, session, expected,
                          got[:300])
        if len(self.findings) < SHOWN:
            self.findings.append(finding)
        self.log(f"FINDING {kind} combo={combination} step={step} op={op} s={session} "
                 f"expected={expected} got={got[:300]}")

    def report(self) -> list[dict]:
        return [asdict(f) for f in self.findings]


def error_kind(exc: BaseException) -> str:
    """The failure key an error falls under when the state does not document it."""
    if isinstance(exc, ServerError) or type(exc) is KVTierError \
            or not isinstance(exc, KVTierError):
        return "internal"
    if isinstance(exc, DataLoss | CodecError):
        return "lost"
    return "unexpected"


def named(exc: BaseException) -> str:
    text = str(exc).replace("\n", " ")
    return f"{type(exc).__name__}: {text[:200]}"


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, NotFound)


def now() -> float:
    return time.monotonic()
