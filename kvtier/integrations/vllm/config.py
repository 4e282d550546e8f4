"""The connector's settings: vLLM's ``kv_connector_extra_config``, checked once.

Keys (all strings unless said): ``server`` (host:port, default 127.0.0.1:50051), ``tls_ca``
(a CA file: TLS on), ``token`` or ``token_file`` (a bearer token), ``tenant`` (default
"default"), ``model_fingerprint`` (required: the weights' identity, bound into every chunk
key), ``value_format`` ("auto", "portable", "int8", "fp8_e4m3"), ``dedupe_domain`` ("" for the
tenant's own), ``ack`` ("memory" or "durable"), ``timeout_s`` (number: the most one store
call may take, default 10).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvstore.format.errors import InvalidRequest, shown

VALUE_FORMATS = ("auto", "portable", "int8", "fp8_e4m3")
ACKS = ("memory", "durable")
KEYS = ("server", "tls_ca", "token", "token_file", "tenant", "model_fingerprint",
        "value_format", "dedupe_domain", "ack", "timeout_s")


@dataclass(frozen=True)
class ConnectorConfig:
    server: str = "127.0.0.1:50051"
    tls_ca: str | None = None
    token: str | None = None
    tenant: str = "default"
    model_fingerprint: str = ""
    value_format: str = "auto"
    dedupe_domain: str = ""
    ack: str = "memory"
    timeout_s: float = 10.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> ConnectorConfig:
        """The settings of ``extra`` (vLLM's kv_connector_extra_config); an unknown key,
        a bad value or a missing fingerprint is ``InvalidRequest``."""
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise InvalidRequest(f"kvtier connector: unknown kv_connector_extra_config keys "
                                 f"{unknown}; known: {list(KEYS)}")
        if extra.get("token") and extra.get("token_file"):
            raise InvalidRequest("kvtier connector: give token or token_file, not both")
        token = extra.get("token") or None
        if extra.get("token_file"):
            token = Path(str(extra["token_file"])).read_text().strip()
        config = cls(
            server=str(extra.get("server") or cls.server),
            tls_ca=str(extra["tls_ca"]) if extra.get("tls_ca") else None,
            token=str(token) if token else None,
            tenant=str(extra.get("tenant") or cls.tenant),
            model_fingerprint=str(extra.get("model_fingerprint") or ""),
            value_format=str(extra.get("value_format") or cls.value_format),
            dedupe_domain=str(extra.get("dedupe_domain") or ""),
            ack=str(extra.get("ack") or cls.ack),
            timeout_s=float(extra.get("timeout_s") or cls.timeout_s))
        if not config.model_fingerprint:
            raise InvalidRequest("kvtier connector: model_fingerprint is required (the id of "
                                 "the weights, e.g. a hash or name@revision): chunk keys bind "
                                 "it, so two models never share KV")
        if config.value_format not in VALUE_FORMATS:
            raise InvalidRequest(f"kvtier connector: value_format must be one of "
                                 f"{VALUE_FORMATS}, got {shown(config.value_format)}")
        if config.ack not in ACKS:
            raise InvalidRequest(f"kvtier connector: ack must be one of {ACKS}, got "
                                 f"{shown(config.ack)}")
        if not config.timeout_s > 0:
            raise InvalidRequest(f"kvtier connector: timeout_s must be > 0, got "
                                 f"{config.timeout_s}")
        return config

    def client_options(self) -> dict:
        """Keyword arguments of ``kvtier.Client`` for this server."""
        return {"tls_ca": self.tls_ca, "token": self.token, "timeout_s": self.timeout_s}
