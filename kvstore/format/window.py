"""The window blob: a session's ephemeral streams as chunks that end at its last token,
pending rows of ``n mod m`` tokens (``kvstore.format.checks.pending_counts``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvstore.format.checks import check_pending
from kvstore.format.chunk import StreamData, encode_chunk
from kvstore.format.errors import InvalidRequest, LayoutMismatch
from kvstore.format.layout import LayoutSpec


def encode_window(spec: LayoutSpec, tokens: np.ndarray,
                  window: Mapping[str, StreamData]) -> bytes:
    """Encode ephemeral streams as the window blob: streams covering the same number of
    tokens (the window K/V over the last W tokens; the pending rows of an unfinished
    entry) become one ephemeral chunk each, ending at the session's last token."""
    known = {s.name: s for s in spec.ephemeral_streams}
    if not window or set(window) - set(known):
        raise LayoutMismatch(f"window streams must be some of {sorted(known)}, "
                             f"got {sorted(window)}")
    groups: dict[int, dict[str, StreamData]] = {}
    for name, data in window.items():
        if not isinstance(data, StreamData) or data.codes.dim() < 2:
            raise InvalidRequest(f"window stream {name} must be a StreamData with codes "
                                 "(layers, entries, ...)")
        covered = data.codes.shape[1] * known[name].tokens_per_entry
        groups.setdefault(covered, {})[name] = data
    parts = []
    for covered, streams in sorted(groups.items(), reverse=True):
        if covered > len(tokens):
            raise InvalidRequest(f"window streams {sorted(streams)} cover {covered} tokens; "
                                 f"the session has {len(tokens)}")
        if covered:
            start = len(tokens) - covered
            check_pending(spec, len(tokens), covered, [known[n] for n in streams])
            parts.append(encode_chunk(spec, start, tokens[start:], streams, ephemeral=True))
    return b"".join(parts)

