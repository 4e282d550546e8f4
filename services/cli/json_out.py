"""Replies as JSON for the ``--json`` of the tools, in protobuf's JSON mapping of the
reply they stand for: camelCase keys, every field present but a submessage or optional
field the server left unset (None here), numbers as JSON numbers (a Python double holds
every count and byte size a server reports exactly, up to 2**53)."""

from __future__ import annotations

import dataclasses
from typing import Any


def value_json(value: Any) -> Any:
    """``value`` (a ``kvtier.types`` dataclass, or a list, dict or scalar in one) as a
    JSON-ready value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {_camel(f.name): value_json(getattr(value, f.name))
                for f in dataclasses.fields(value) if getattr(value, f.name) is not None}
    if isinstance(value, list):
        return [value_json(item) for item in value]
    if isinstance(value, dict):
        return {key: value_json(item) for key, item in value.items()}
    return value


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)
