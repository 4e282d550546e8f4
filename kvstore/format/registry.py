"""This process's layouts: the shipped presets, and any a caller registers, by name."""

from __future__ import annotations

from kvstore.format.errors import InvalidRequest, UnknownLayout, shown
from kvstore.format.layout import LayoutSpec
from kvstore.format.presets import SHIPPED

_REGISTRY: dict[str, LayoutSpec] = {}


def register_layout(spec: LayoutSpec) -> LayoutSpec:
    """Add ``spec`` to this process's layouts; the one already registered when it is the
    same layout (idempotent), InvalidRequest when its name is taken by another."""
    known = _REGISTRY.get(spec.name)
    if known is not None:
        if known.layout_hash != spec.layout_hash:
            raise InvalidRequest(f"layout name {spec.name!r} is already registered as "
                                 f"{known.layout_id}, with another shape")
        if known.replayer != spec.replayer:
            raise InvalidRequest(f"layout {known.layout_id} is already registered with "
                                 f"replayer {known.replayer!r}, not {spec.replayer!r}")
        if known.replay_tokens != spec.replay_tokens:
            raise InvalidRequest(f"layout {known.layout_id} is already registered with "
                                 f"replay_tokens {known.replay_tokens}, not "
                                 f"{spec.replay_tokens}")
        return known
    _REGISTRY[spec.name] = spec
    return spec


def get_layout(name_or_id: str) -> LayoutSpec:
    """Look a spec up by name or by full layout id (``name@hash``)."""
    name, _, wanted_hash = name_or_id.partition("@")
    spec = _REGISTRY.get(name)
    if spec is None:
        # Registered names belong to their tenants: the message names only the presets.
        others = len(_REGISTRY) - len(SHIPPED)
        raise UnknownLayout(f"unknown layout {shown(name_or_id)}; shipped: "
                            f"{sorted(spec.name for spec in SHIPPED)}"
                            + (f" and {others} registered" if others > 0 else ""))
    if wanted_hash and wanted_hash != f"{spec.layout_hash:016x}":
        raise UnknownLayout(
            f"layout {name!r} is known as {spec.layout_id}, not {shown(name_or_id)} "
            "(spec changed?)"
        )
    return spec


def layout_by_hash(layout_hash: int) -> LayoutSpec:
    for spec in _REGISTRY.values():
        if spec.layout_hash == layout_hash:
            return spec
    raise UnknownLayout(f"no registered layout has hash {layout_hash:016x}")


def all_layouts() -> list[LayoutSpec]:
    return list(_REGISTRY.values())


for _spec in SHIPPED:
    register_layout(_spec)
