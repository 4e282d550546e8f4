"""The backend's settings: SGLang's ``hicache_storage_backend_extra_config``, checked once.

Keys: ``server`` (host:port, default 127.0.0.1:50051), ``tls_ca`` (a CA file: TLS on),
``token_file`` (a file holding a bearer token; the token itself never sits in SGLang's
config, which it logs), ``tenant`` (default "default"), ``model_fingerprint`` (required:
the weights' identity, bound into every page's key, so two models never share a page),
``dedupe_domain`` ("" for the tenant's own), ``ack`` ("memory" or "durable"),
``timeout_ms`` (number: the most one SGLang call may wait for kvtier, default 1000).
SGLang's own keys of the dynamic backend (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``, ``tp_lcm_size``) pass through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ACKS = ("memory", "durable")
KEYS = ("server", "tls_ca", "token_file", "tenant", "model_fingerprint", "dedupe_domain",
        "ack", "timeout_ms")
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")


@dataclass(frozen=True)
class StorageSettings:
    server: str = "127.0.0.1:50051"
    tls_ca: str | None = None
    token: str | None = None
    tenant: str = "default"
    model_fingerprint: str = ""
    dedupe_domain: str = ""
    ack: str = "memory"
    timeout_ms: float = 1000.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> StorageSettings:  # SGLang's JSON
        """The settings of ``extra``; an unknown key or a bad value is a ValueError
        naming it (SGLang fails the start-up with it)."""
        unknown = sorted(set(extra) - set(KEYS) - set(SGLANG_KEYS))
        if unknown:
            raise ValueError(f"kvtier sglang storage: unknown extra_config keys {unknown}; "
                             f"known: {list(KEYS)}")
        token = None
        if extra.get("token_file"):
            try:
                token = Path(str(extra["token_file"])).read_text().strip()
            except OSError as exc:
                raise ValueError(f"kvtier sglang storage: token_file cannot be read: "
                                 f"{exc.strerror}") from exc
        try:
            timeout_ms = float(extra.get("timeout_ms") or cls.timeout_ms)
        except (TypeError, ValueError) as exc:
            raise ValueError("kvtier sglang storage: timeout_ms must be a number of "
                             "milliseconds") from exc
        settings = cls(
            server=str(extra.get("server") or cls.server),
            tls_ca=str(extra["tls_ca"]) if extra.get("tls_ca") else None,
            token=token or None,
            tenant=str(extra.get("tenant") or cls.tenant),
            model_fingerprint=str(extra.get("model_fingerprint") or ""),
            dedupe_domain=str(extra.get("dedupe_domain") or ""),
            ack=str(extra.get("ack") or cls.ack),
            timeout_ms=timeout_ms)
        if not settings.model_fingerprint:
            raise ValueError("kvtier sglang storage: model_fingerprint is required (the id "
                             "of the weights, e.g. a hash or name@revision): page keys bind "
                             "it, so two models never share KV")
        if settings.ack not in ACKS:
            raise ValueError(f"kvtier sglang storage: ack must be one of {ACKS}")
        if not settings.timeout_ms > 0:
            raise ValueError(f"kvtier sglang storage: timeout_ms must be > 0, got "
                             f"{settings.timeout_ms}")
        return settings

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments of ``kvtier.Client``: a call's own deadline is the
        backend's, so the client gives up when SGLang's caller does."""
        return {"tls_ca": self.tls_ca, "token": self.token, "timeout_s": self.timeout_s}
