"""A conformance suite for any kvtier server: ``python -m kvtier.conformance --server
ADDR [--tls-ca F --token T --tenant X --json]`` runs named checks of docs/wire-format.md
and proto/kvtier.proto against it (``kvtier.conformance.checks``) and exits 1 if one
fails. It spills sessions of its own layouts (``kvtier.conformance.sessions``, registered
with RegisterLayout: the caller must be allowed to) under ``--tenant`` and deletes them
afterwards. It needs grpc, the proto and ``kvstore.format`` only: no torch."""

from kvtier.conformance.checks import all_checks
from kvtier.conformance.harness import Context, Result, run

__all__ = ["Context", "Result", "all_checks", "run"]
