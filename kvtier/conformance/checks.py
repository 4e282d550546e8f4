"""The conformance checks, one module per concept, run in this order. RPCs added to the
contract add a module of their own with its ``CHECKS`` (WriteChunks / ReadChunks: in
``CHUNK_RPCS`` below) and nothing else here changes."""

from __future__ import annotations

from kvtier.conformance import (
    golden,
    layers,
    limits,
    listing,
    prefix_chunks,
    roundtrip,
    sharing,
    statuses,
    window,
)
from kvtier.conformance.harness import Check

SESSIONS = (roundtrip, layers, window, sharing, statuses, listing, limits, golden)
CHUNK_RPCS = (prefix_chunks,)  # WriteChunks / ReadChunks


def all_checks() -> list[Check]:
    return [check for module in (*SESSIONS, *CHUNK_RPCS) for check in module.CHECKS]
