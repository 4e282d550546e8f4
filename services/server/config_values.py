"""How configuration values are spelled, parsed or checked one by one: sizes
(``"64MiB"``), flags, listen addresses, URLs, and the dedupe-domain and quota tables in
their TOML and environment forms (``services.server.config`` puts them together)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from kvstore.format.errors import InvalidRequest
from kvstore.tiers.common import without_password

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def check_listen(name: str, address: str) -> None:
    if address.startswith("unix:"):
        return
    _, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise InvalidRequest(f"{name} must be HOST:PORT (port 0: a free one), got {address!r}")


_DOMAIN = re.compile(r"^[a-z0-9_-]{1,64}$")  # as tenant ids


def check_domains(domains: object) -> None:
    if not isinstance(domains, Mapping):
        raise InvalidRequest("dedupe_domains must be a table of domain = [tenants]")
    for name, tenants in domains.items():
        if not isinstance(name, str) or not _DOMAIN.match(name):
            raise InvalidRequest(f"dedupe_domains: domain name {name!r} must match "
                                 f"{_DOMAIN.pattern}")
        if isinstance(tenants, str) or not all(
                isinstance(t, str) and _DOMAIN.match(t) for t in tenants):
            raise InvalidRequest(f"dedupe_domains.{name} must list tenant ids "
                                 f"({_DOMAIN.pattern}), got {tenants!r}")


def domains_value(value: object) -> object:
    """``name=t1,t2;name2=t3`` (the environment's form) or a TOML table as it is."""
    if not isinstance(value, str):
        return value
    out: dict[str, tuple[str, ...]] = {}
    for entry in filter(None, (part.strip() for part in value.split(";"))):
        name, eq, tenants = entry.partition("=")
        if not eq:
            raise ValueError(f"{entry!r} is not name=tenant,tenant")
        out[name.strip()] = tuple(t.strip() for t in tenants.split(",") if t.strip())
    return out


def quota_tables(value: object) -> dict[str, dict[str, object]]:
    """``[quota.*]`` TOML tables or the environment's ``tenant.key=value;...``, with sizes
    (``memory_bytes``, ``durable_bytes``) and string counts turned into ints."""
    if isinstance(value, str):
        tables: dict[str, dict[str, object]] = {}
        for entry in filter(None, (part.strip() for part in value.split(";"))):
            where, eq, raw = entry.partition("=")
            name, dot, key = where.strip().partition(".")
            if not eq or not dot:
                raise ValueError(f"{entry!r} is not tenant.key=value")
            tables.setdefault(name, {})[key] = raw.strip()
        value = tables
    if not isinstance(value, Mapping) or not all(isinstance(t, Mapping) for t in value.values()):
        raise ValueError("quotas are [quota.default] and [quota.<tenant>] tables")
    return {name: {key: parse_size(v) if key.endswith("_bytes")
                   else int(v) if isinstance(v, str) else v for key, v in table.items()}
            for name, table in value.items()}


def check_url(name: str, url: str, schemes: tuple[str, ...]) -> None:
    """An empty URL leaves its tier out; any other must be of one of ``schemes``."""
    if not url:
        return
    parts = urlsplit(url)
    needs_host = parts.scheme != "unix"
    if parts.scheme not in schemes or (needs_host and not parts.netloc) \
            or (not needs_host and not parts.path):
        wanted = ", ".join(f"{scheme}://" for scheme in schemes)
        raise InvalidRequest(f"{name} must be a URL starting with one of {wanted}; got "
                             f"{without_password(url)!r}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}


def parse_size(value: object) -> int:
    """``4096``, ``"4096"``, ``"64MiB"``, ``"1.5GB"`` -> bytes."""
    if isinstance(value, bool):
        raise InvalidRequest(f"not a size: {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise InvalidRequest(f"not a size: {value!r} (use bytes or e.g. '64MiB')")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "b").lower()])


def flag(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("not a boolean (true or false)")
