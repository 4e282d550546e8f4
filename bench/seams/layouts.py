"""Layouts a simulation registers: valid copies of the bundled one, and hostile ones a
server must refuse or serve safely (never INTERNAL, never an unbounded allocation)."""

from __future__ import annotations

import json

from kvstore.format.layout import layout_to_json
from kvstore.format.registry import get_layout

BUNDLED = "kvtier-bundled"


def hostile_layouts() -> list[tuple[str, str]]:
    """(what, layout JSON) of registrations a server must refuse or serve safely."""
    base = json.loads(layout_to_json(get_layout(BUNDLED)))

    def variant(name: str, change) -> tuple[str, str]:
        spec = json.loads(json.dumps(base))
        spec["name"] = f"seams-hostile-{name}"
        change(spec)
        return name, json.dumps(spec)

    def stream(key, value):
        return lambda s: s["streams"][0].__setitem__(key, value)

    return [
        variant("vocab-2e32", lambda s: s.__setitem__("vocab_size", 2**32)),
        variant("vocab-0", lambda s: s.__setitem__("vocab_size", 0)),
        variant("window-1e9", lambda s: s.__setitem__("window_tokens", 10**9)),
        variant("chunk-3", lambda s: s.__setitem__("chunk_tokens", 3)),
        variant("layers-1e7", stream("layers", 10**7)),
        variant("entry-0", stream("tokens_per_entry", 0)),
        variant("shape-2e31", stream("entry_shape", [2**31])),
        variant("bits-3", stream("bits", 3)),
        variant("group-7", stream("group_size", 7)),
        variant("no-persistent", lambda s: [st.__setitem__("persistent", False)
                                            for st in s["streams"]]),
        variant("path-name", lambda s: s.__setitem__("name", "../../seams")),
        ("name-collision", json.dumps({**base, "vocab_size": 512})),
    ]
