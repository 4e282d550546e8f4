"""Replies as JSON for the ``--json`` of the tools: protobuf's JSON mapping (camelCase
keys, every field present), except that 64-bit integers stay numbers. The mapping writes
them as strings (``"sessions": "111"``) for JavaScript's sake; a Python double holds
every count and byte size a server reports exactly, up to 2**53."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

_WIDE = frozenset({FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64,
                   FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_FIXED64,
                   FieldDescriptor.TYPE_SFIXED64})


def message_json(message: Message) -> dict[str, Any]:
    """``message`` as a JSON-ready dict with 64-bit integers as numbers."""
    return _numbers(message.DESCRIPTOR,
                    MessageToDict(message, always_print_fields_with_no_presence=True))


def _numbers(descriptor: Descriptor, value: dict[str, Any]) -> dict[str, Any]:
    for field in descriptor.fields:
        if field.json_name not in value:
            continue
        found = value[field.json_name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            item = field.message_type.fields_by_name["value"]
            value[field.json_name] = {k: _one(item, v) for k, v in found.items()}
        elif field.is_repeated:
            value[field.json_name] = [_one(field, v) for v in found]
        else:
            value[field.json_name] = _one(field, found)
    return value


def _one(field: FieldDescriptor, value: Any) -> Any:
    if field.type in _WIDE:
        return int(value)
    if field.message_type is not None and isinstance(value, dict):
        return _numbers(field.message_type, value)
    return value
