"""The layouts a client knows: this process's registry (``kvstore.format.registry``: the
presets and whatever it registered), then those the server listed (ListLayouts) or
registered for it, so a client that defines no layout of its own still spills and restores
any the server serves."""

from __future__ import annotations

from kvstore.format.errors import LayoutMismatch, UnknownLayout
from kvstore.format.layout import LayoutSpec, layout_from_json
from kvstore.format.registry import get_layout
from kvtier.types import LayoutInfo
from proto import kvtier_pb2 as pb


def info_from(message: pb.LayoutInfo) -> LayoutInfo:
    """A LayoutInfo whose JSON is checked to hash to the id the server gave it."""
    spec = layout_from_json(message.layout_json)
    if spec.layout_id != message.layout_id:  # another encoding or hash: not the same layout
        raise LayoutMismatch(f"the server lists layout {message.layout_id} with JSON that "
                             f"hashes to {spec.layout_id} here")
    return LayoutInfo(message.layout_id, message.layout_json, message.replayer,
                      message.builtin, spec)


class KnownLayouts:
    def __init__(self) -> None:
        self._from_server: dict[str, LayoutSpec] = {}  # layout id -> spec

    def add(self, info: LayoutInfo) -> None:
        self._from_server[info.layout_id] = info.spec

    def find(self, name_or_id: str) -> LayoutSpec | None:
        try:
            return get_layout(name_or_id)
        except UnknownLayout:
            pass
        name, at, _ = name_or_id.partition("@")
        if at:
            return self._from_server.get(name_or_id)
        return next((s for s in self._from_server.values() if s.name == name), None)
