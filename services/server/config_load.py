"""A ``ServerConfig`` from a named preset, a TOML file, ``KVTIER_*`` environment variables
and explicit overrides, in that order of precedence (``services.server.config``)."""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstore.format.errors import InvalidRequest
from services.server.config import (
    DEFAULT_METRICS_PORT,
    DEFAULT_PORT,
    DEFAULT_REPLAY_PORT,
    ENV_PREFIX,
    ServerConfig,
)
from services.server.config_values import GiB, MiB, domains_value, flag, parse_size, quota_tables

PRESETS: dict[str, ServerConfig] = {
    "embedded": ServerConfig(),
    # What docker-compose.yml runs: every tier on, replay on a worker container.
    "compose": ServerConfig(
        listen=f"0.0.0.0:{DEFAULT_PORT}", data_dir=Path("/data"),
        redis_url="redis://redis:6379/0", metrics_port=DEFAULT_METRICS_PORT,
        metrics_host="0.0.0.0",  # scraped from the prometheus container
        replay_workers=(f"replay-worker:{DEFAULT_REPLAY_PORT}",),
    ),
    # Small capacities so a few test sessions reach every tier.
    "test": ServerConfig(
        listen="127.0.0.1:0", host_bytes=4 * MiB, disk_bytes=256 * MiB,
        object_bytes=1 * GiB, object_compression_level=-1, metrics_interval_s=0.2,
        grace_s=2.0, replay_warmup=False,
    ),
}

_FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}


def _coerce(name: str, value: Any) -> object:  # noqa: C901 - one branch per kind of config field
    kind = _FIELDS[name].type
    try:
        if name.endswith("_bytes"):
            return parse_size(value)
        if kind == "bool":
            return flag(value)
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "Path":
            return Path(str(value))
        if name == "quota":
            return quota_tables(value)
        if kind.startswith("Mapping"):
            return domains_value(value)
        if name == "layouts" and not isinstance(value, str):
            # TOML inline tables are layouts too: kept as the JSON they spell
            return tuple(json.dumps(item) if isinstance(item, Mapping) else str(item)
                         for item in value)
        if kind.startswith("tuple"):
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(item.strip() for item in items if item.strip())
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"config {name}: cannot use {value!r}: {exc}") from exc
    return str(value)


def _coerced(values: Mapping[str, object], source: str) -> dict[str, object]:
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise InvalidRequest(f"{source}: unknown config keys {unknown}; known: {sorted(_FIELDS)}")
    return {k: _coerce(k, v) for k, v in values.items()}


def env_values(env: Mapping[str, str]) -> dict[str, str]:
    """The ``KVTIER_<FIELD>`` variables of ``env`` as field -> raw string."""
    return {name: env[ENV_PREFIX + name.upper()]
            for name in _FIELDS if ENV_PREFIX + name.upper() in env}


def load_config(
    path: str | os.PathLike | None = None,
    *,
    preset: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> ServerConfig:
    """Build the server's config: preset < TOML file < ``KVTIER_*`` env < overrides."""
    env = os.environ if env is None else env
    from_file: dict[str, object] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                from_file = tomllib.load(handle)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidRequest(f"cannot read config file {path}: {exc}") from exc
    name = preset or str(from_file.pop("preset", "") or env.get(ENV_PREFIX + "PRESET", "")
                         or "embedded")
    from_file.pop("preset", None)
    if name not in PRESETS:
        raise InvalidRequest(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    # One replace of the merged values: a setting that needs another (tls_cert and
    # tls_key) may come from different sources.
    values = _coerced(from_file, f"config file {path}")
    values |= _coerced(env_values(env), "environment")
    values |= _coerced({k: v for k, v in (overrides or {}).items() if v is not None},
                       "overrides")
    return PRESETS[name].replace(**values)


def field_names() -> list[str]:
    return list(_FIELDS)


