"""Bounds on request messages, checked on their raw bytes before protobuf parses them.

Parsing a message, and what a handler then does over its fields (token ids checked and
hashed into chain keys, lists walked), runs on the server's one event loop, so the size
of what reaches a parser bounds that work. Per method of the KVTier service:

- Spill, WriteChunks: a message over ``max_header_bytes`` must be exactly one payload
  field (chunk, tail or window: bytes the layout bounds, copied not walked); a header is
  at most ``max_header_bytes``;
- AdoptWindow: a message over ``CONTROL_BYTES`` must be exactly the window (its header
  states its length, checked against the layout's bound before it is read);
- Lookup, ReadChunks (token ids, hashed into chain keys): at most ``max_header_bytes``;
- RegisterLayout: the layout JSON bound (``kvstore.format.layout_bounds.MAX_JSON_BYTES``)
  and a margin;
- every other method: ``CONTROL_BYTES``.

gRPC's own limit (``max_message_bytes``) comes first. A message past its bound is never
parsed: the call ends with INVALID_ARGUMENT naming its size and the bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from kvstore.format.errors import InvalidRequest
from kvstore.format.layout_bounds import MAX_JSON_BYTES
from services.serving.errors import Undecodable

CONTROL_BYTES = 64 << 10  # a session ref, a few names and numbers, a page of ids
# The oneof fields of the client-streamed requests that carry payloads, and their names
PAYLOAD_FIELDS: dict[str, tuple[frozenset[int], str]] = {
    "Spill": (frozenset({2, 3, 4}), "chunk, tail or window"),
    "WriteChunks": (frozenset({2}), "chunk"),
    "AdoptWindow": (frozenset({2}), "window"),
}
_LENGTH_DELIMITED = 2


class _Oversized(Undecodable):
    """What the handler gets for a message past its bound (refused like bytes that do
    not parse, by ``services.serving.errors.add_servicer``)."""

    def __init__(self, error: InvalidRequest) -> None:
        self.error = error


class _SizedParser:
    """A request deserializer that parses only messages inside the method's bound."""

    def __init__(self, parse: Callable[[bytes], Any], method: str, limit: int,
                 setting: str) -> None:
        self.parse_message = parse
        # the type, for the parse errors (parse is its bound FromString)
        self.DESCRIPTOR = getattr(parse, "__self__").DESCRIPTOR  # noqa: B009 - undeclared
        self.method, self.limit, self.setting = method, limit, setting
        self.payloads, self.payload_names = PAYLOAD_FIELDS.get(method, (frozenset(), ""))

    def parse(self, raw: bytes) -> Any:
        if len(raw) <= self.limit or self._one_payload(raw):
            return self.parse_message(raw)
        bound = f"{self.setting} = {self.limit} B" if self.setting else f"{self.limit} B"
        if self.payloads and _first_field(raw) == (1, len(raw)):  # one header field
            what = f"the {self.method} header is {len(raw)} B, over the limit ({bound})"
        elif self.payloads:
            what = (f"a {self.method} message of {len(raw)} B (over {bound}) must carry one "
                    f"{self.payload_names} payload and nothing else")
        else:
            what = f"a {self.method} request is {len(raw)} B, over the limit ({bound})"
        return _Oversized(InvalidRequest(what))

    def _one_payload(self, raw: bytes) -> bool:
        number, end = _first_field(raw)
        return number in self.payloads and end == len(raw)


def _varint(raw: bytes, at: int) -> tuple[int, int]:
    """(value, offset after it); offset -1 when ``raw`` ends inside it."""
    value = shift = 0
    for i in range(at, min(at + 10, len(raw))):
        value |= (raw[i] & 0x7F) << shift
        if raw[i] < 0x80:
            return value, i + 1
        shift += 7
    return 0, -1


def _first_field(raw: bytes) -> tuple[int, int]:
    """(field number, offset past its value) of the message's first field, if it is
    length-delimited; offset -1 otherwise."""
    tag, at = _varint(raw, 0)
    if at < 0 or tag & 7 != _LENGTH_DELIMITED:
        return tag >> 3, -1
    length, at = _varint(raw, at)
    return tag >> 3, (at + length if at >= 0 else -1)




def request_limits(max_header_bytes: int) -> dict[str, tuple[int, str]]:
    """Method -> (bound in bytes, the config key that sets it or "")."""
    return {"Spill": (max_header_bytes, "max_header_bytes"),
            "WriteChunks": (max_header_bytes, "max_header_bytes"),
            "Lookup": (max_header_bytes, "max_header_bytes"),
            "ReadChunks": (max_header_bytes, "max_header_bytes"),
            "RegisterLayout": (MAX_JSON_BYTES + CONTROL_BYTES, "")}


def bounded(add: Callable[[object, object], None], max_header_bytes: int
            ) -> Callable[[object, object], None]:
    """``add`` (a generated ``add_*Servicer_to_server``) with every method's request
    deserializer bounded as the module docstring says."""
    limits = request_limits(max_header_bytes)

    def add_bounded(servicer: object, server: object) -> None:
        add(servicer, _Bounding(server, limits))

    return add_bounded


class _Bounding:
    """Stands in for the server ``add`` registers with, bounding each handler."""

    def __init__(self, server: Any, limits: dict[str, tuple[int, str]]) -> None:
        self.server, self.limits = server, limits

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # services.serving.errors.add_servicer registers both kinds from the registered ones

    def add_registered_method_handlers(self, service: str,
                                       handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        sized = {}
        for name, handler in handlers.items():
            limit, setting = self.limits.get(name, (CONTROL_BYTES, ""))
            assert handler.request_deserializer is not None  # a generated handler has one
            parser = _SizedParser(handler.request_deserializer, name, limit, setting)
            # a namedtuple at run time: grpc's stubs leave out its _replace
            sized[name] = handler._replace(  # type: ignore[attr-defined]
                request_deserializer=parser.parse)
        self.server.add_registered_method_handlers(service, sized)
