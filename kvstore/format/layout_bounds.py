"""Bounds on a layout from an untrusted source (RegisterLayout, a replay request, a fleet's
bucket): every size a layout implies is bounded by the layout, so bounding the layout
bounds what a session of it can make a server hold."""

from __future__ import annotations

from kvstore.format.checks import chunk_bytes_max, window_bytes_max
from kvstore.format.errors import InvalidRequest
from kvstore.format.layout import LayoutSpec, layout_from_json

MESSAGE_MARGIN = 4096  # the fields around a payload in a message
# R of a replay (docs/wire-format.md section 7), refused past it by the server before any
# work and by a replay worker too: far past any useful one, a bound on what one may cost
MAX_REPLAY_TOKENS = 8192
MAX_JSON_BYTES = 64 << 10
MAX_STREAMS = 64
MAX_DIMS = 4
MAX_ENTRY_VALUES = 1 << 20
MAX_PAGE_BYTES = 1 << 22  # a page entry's bytes: one paged block of one layer
MAX_LAYER_SECTIONS = 1 << 14  # layers of all streams together (each a codec section)
MAX_TOKENS_PER_ENTRY = 1024
MAX_CHUNK_TOKENS = 1 << 16
MAX_WINDOW_TOKENS = 1 << 16
MAX_LAYER_MODES = 4096


def check_bounds(spec: LayoutSpec, max_message_bytes: int) -> None:
    """InvalidRequest unless ``spec`` stays inside the bounds above, and one chunk and
    one window blob of it fit in a message."""
    what = f"layout {spec.name}"
    if not 1 <= len(spec.streams) <= MAX_STREAMS or not spec.persistent_streams:
        raise InvalidRequest(f"{what}: needs 1 to {MAX_STREAMS} streams, one persistent at "
                             f"least; has {len(spec.streams)}")
    for s in spec.streams:
        most = MAX_PAGE_BYTES if s.format == "page" else MAX_ENTRY_VALUES
        if len(s.entry_shape) > MAX_DIMS or s.values_per_entry > most:
            raise InvalidRequest(f"{what}: stream {s.name}'s entry must have at most "
                                 f"{MAX_DIMS} dimensions and {most} values")
        if s.tokens_per_entry > MAX_TOKENS_PER_ENTRY:
            raise InvalidRequest(f"{what}: stream {s.name}: tokens_per_entry at most "
                                 f"{MAX_TOKENS_PER_ENTRY}")
    if sum(s.layers for s in spec.streams) > MAX_LAYER_SECTIONS:
        raise InvalidRequest(f"{what}: its streams' layers add up to more than "
                             f"{MAX_LAYER_SECTIONS}")
    if spec.chunk_tokens > MAX_CHUNK_TOKENS or spec.window_tokens > MAX_WINDOW_TOKENS:
        raise InvalidRequest(f"{what}: chunk_tokens and window_tokens must be at most "
                             f"{MAX_CHUNK_TOKENS} and {MAX_WINDOW_TOKENS}")
    if len(spec.layer_modes) > MAX_LAYER_MODES:
        raise InvalidRequest(f"{what}: at most {MAX_LAYER_MODES} layer modes")
    room = max_message_bytes - MESSAGE_MARGIN
    # Plain arithmetic first, so the codec's plans are only made for bounded layouts.
    rough = (spec.chunk_tokens * spec.persistent_bytes_per_token
             + spec.window_tokens * spec.ephemeral_bytes_per_token)
    if rough > room or chunk_bytes_max(spec, spec.chunk_tokens) > room \
            or window_bytes_max(spec) > room:
        raise InvalidRequest(f"{what}: a chunk or a window of it would exceed the {room} B "
                             "a message can carry: fewer chunk_tokens, or smaller entries")


def parse_layout(text: str, max_message_bytes: int) -> LayoutSpec:
    """A layout sent by a client or a peer (RegisterLayout, a replay request, the fleet's
    bucket): at most MAX_JSON_BYTES of JSON, inside ``check_bounds``."""
    if len(text.encode()) > MAX_JSON_BYTES:
        raise InvalidRequest(f"layout_json is over {MAX_JSON_BYTES} bytes")
    spec = layout_from_json(text)
    check_bounds(spec, max_message_bytes)
    return spec
