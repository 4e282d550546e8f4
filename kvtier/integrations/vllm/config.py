"""The connector's settings: vLLM's ``kv_connector_extra_config``, checked once, when the
connector is built (a bad key is a ``ValueError`` naming it).

Keys (all strings unless said): ``server`` (host:port, default 127.0.0.1:50051), ``tls_ca``
(a CA file: TLS on), ``token_file`` (a file holding the bearer token; a ``token`` itself is
refused: vLLM prints the extra config at startup), ``tenant`` (default "default"),
``model_fingerprint`` (required: the weights' identity, bound into every chunk key),
``value_format`` ("auto": the engine's own pages; "portable": exact token-major values;
"int8", "int4", "fp8_e4m3"), ``dedupe_domain`` ("" for the tenant's own),
``ack`` ("memory" or "durable"), ``timeout_s`` (number: the most one store call may take,
default 10), ``lookup_timeout_ms`` (number: how long the scheduler waits for a lookup before
it is a miss, default 30), ``save_queue_depth`` (int: saves and spills waiting for the
background writer; a save beyond it is skipped, default 8), ``breaker_failures`` (int:
consecutive failures that take kvtier as down, default 3), ``probe_interval_s`` (number:
how often a down kvtier is tried again, default 2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.format.errors import shown

VALUE_FORMATS = ("auto", "portable", "int8", "int4", "fp8_e4m3")
ACKS = ("memory", "durable")
KEYS = ("server", "tls_ca", "token_file", "tenant", "model_fingerprint", "value_format",
        "dedupe_domain", "ack", "timeout_s", "lookup_timeout_ms", "save_queue_depth",
        "breaker_failures", "probe_interval_s")


class ConfigError(ValueError):
    """A bad ``kv_connector_extra_config``; the message names the key."""


@dataclass(frozen=True)
class ConnectorConfig:
    server: str = "127.0.0.1:50051"
    tls_ca: str | None = None
    token: str | None = field(default=None, repr=False)  # from token_file; never printed
    tenant: str = "default"
    model_fingerprint: str = ""
    value_format: str = "auto"
    dedupe_domain: str = ""
    ack: str = "memory"
    timeout_s: float = 10.0
    lookup_timeout_ms: float = 30.0
    save_queue_depth: int = 8
    breaker_failures: int = 3
    probe_interval_s: float = 2.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> ConnectorConfig:
        """The settings of ``extra`` (vLLM's kv_connector_extra_config); an unknown key,
        a bad value or a missing fingerprint is a ``ConfigError`` (a ``ValueError``)
        naming the key."""
        if "token" in extra:
            raise ConfigError("kvtier connector: kv_connector_extra_config key 'token' is "
                              "refused: vLLM prints the extra config at startup, so the "
                              "secret would be logged; put it in a file and give its path as "
                              "'token_file'")
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ConfigError(f"kvtier connector: unknown kv_connector_extra_config keys "
                              f"{unknown}; known: {list(KEYS)}")
        token = None
        if extra.get("token_file"):
            path = Path(str(extra["token_file"]))
            try:
                token = path.read_text().strip()
            except OSError as exc:
                raise ConfigError(f"kvtier connector: token_file {shown(str(path))} cannot "
                                  f"be read: {exc.strerror or exc}") from None
            if not token:
                raise ConfigError(f"kvtier connector: token_file {shown(str(path))} is empty")
        config = cls(
            server=str(extra.get("server") or cls.server),
            tls_ca=str(extra["tls_ca"]) if extra.get("tls_ca") else None,
            token=token,
            tenant=str(extra.get("tenant") or cls.tenant),
            model_fingerprint=str(extra.get("model_fingerprint") or ""),
            value_format=str(extra.get("value_format") or cls.value_format),
            dedupe_domain=str(extra.get("dedupe_domain") or ""),
            ack=str(extra.get("ack") or cls.ack),
            timeout_s=_number(extra, "timeout_s", cls.timeout_s),
            lookup_timeout_ms=_number(extra, "lookup_timeout_ms", cls.lookup_timeout_ms),
            save_queue_depth=_count(extra, "save_queue_depth", cls.save_queue_depth),
            breaker_failures=_count(extra, "breaker_failures", cls.breaker_failures),
            probe_interval_s=_number(extra, "probe_interval_s", cls.probe_interval_s))
        if not config.model_fingerprint:
            raise ConfigError("kvtier connector: model_fingerprint is required (the id of "
                              "the weights, e.g. a hash or name@revision): chunk keys bind "
                              "it, so two models never share KV")
        if config.value_format not in VALUE_FORMATS:
            raise ConfigError(f"kvtier connector: value_format must be one of "
                              f"{VALUE_FORMATS}, got {shown(config.value_format)}")
        if config.ack not in ACKS:
            raise ConfigError(f"kvtier connector: ack must be one of {ACKS}, got "
                              f"{shown(config.ack)}")
        return config

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments of ``kvtier.Client`` for this server."""
        return {"tls_ca": self.tls_ca, "token": self.token, "timeout_s": self.timeout_s}


def _number(extra: Mapping[str, object], key: str, default: float) -> float:
    """``extra[key]`` as a number > 0, ``default`` when absent."""
    value = extra.get(key)
    if value is None:
        return default
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"kvtier connector: {key} must be a number, got "
                          f"{shown(value)}") from None
    if not number > 0:
        raise ConfigError(f"kvtier connector: {key} must be > 0, got {shown(value)}")
    return number


def _count(extra: Mapping[str, object], key: str, default: int) -> int:
    """``extra[key]`` as a whole number >= 1, ``default`` when absent."""
    value = extra.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | str) \
            or not str(value).strip().isdigit() or int(value) < 1:
        raise ConfigError(f"kvtier connector: {key} must be a whole number >= 1, got "
                          f"{shown(value)}")
    return int(value)
