"""The window blob: a session's ephemeral streams as chunks that end at its last token.

Pending rows (the ephemeral streams marked ``pending``) are the tokens of a persistent
stream's unfinished entry: a part that carries any covers ``n mod m`` tokens of an
``n``-token session, for ``m`` the ``tokens_per_entry`` of one of the persistent streams
(a layout whose persistent streams share one m: ``n mod m``), and ends at token ``n``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvstore.format.chunk import ChunkHeader, StreamData, encode_chunk
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
            _check_pending(spec, len(tokens), covered, [known[n] for n in streams])
            parts.append(encode_chunk(spec, start, tokens[start:], streams, ephemeral=True))
    return b"".join(parts)


def pending_counts(spec: LayoutSpec, num_tokens: int) -> set[int]:
    """The token counts a part with pending rows may cover in a session of ``num_tokens``
    tokens: ``num_tokens mod m`` for each persistent stream's m, 0 left out."""
    return {num_tokens % s.tokens_per_entry for s in spec.persistent_streams} - {0}


def check_part(spec: LayoutSpec, num_tokens: int, header: ChunkHeader) -> None:
    """``InvalidRequest`` unless a window part (checked against the layout already) that
    carries pending rows covers a count of ``pending_counts`` and ends at the session's
    last token."""
    ephemeral = spec.ephemeral_streams
    streams = [ephemeral[i] for i in dict.fromkeys(header.sections["stream"].tolist())]
    _check_pending(spec, num_tokens, header.num_tokens, streams)
    if any(s.pending for s in streams) and \
            header.start_token + header.num_tokens != num_tokens:
        raise InvalidRequest(f"pending rows cover tokens {header.start_token}+"
                             f"{header.num_tokens}; they must end at the session's last "
                             f"token ({num_tokens})")


def _check_pending(spec: LayoutSpec, num_tokens: int, covered: int, streams) -> None:
    pending = [s.name for s in streams if s.pending]
    if pending and covered not in pending_counts(spec, num_tokens):
        ms = sorted({s.tokens_per_entry for s in spec.persistent_streams})
        raise InvalidRequest(f"pending rows {pending} cover {covered} tokens; a session of "
                             f"{num_tokens} tokens has {num_tokens} mod m of them for m in "
                             f"{ms} (layout {spec.name}), one of "
                             f"{sorted(pending_counts(spec, num_tokens))}")
