"""Checks for a spill that names some chunks by key only (bytes ``None``): chunks the
store already holds, which the caller does not send again.

``kvstore.validate.check_spill`` needs every chunk's bytes; this applies the same rules
to what was sent and checks a keys-only chunk by its key alone: the key must be the one
the session's token ids chain to, so a spill can only reference the chunk that holds
exactly its own tokens (the bytes behind it were checked when they were first spilled
and are checked again on every restore).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvstore.codec import tokens_hash, verify_chunk
from kvstore.errors import ChunkCorrupt, InvalidRequest, LayoutMismatch
from kvstore.keys import chain_keys
from kvstore.layout import LayoutSpec
from kvstore.tiers.base import Buffer
from kvstore.validate import restored_chunk_check, window_check


def check_keyed_spill(spec: LayoutSpec, tokens: np.ndarray,
                      chunks: Sequence[tuple[str, Buffer | None]], tail: Buffer,
                      window: Buffer | None) -> None:
    """Raise ``InvalidRequest`` / ``LayoutMismatch`` / ``CodecError`` unless it all fits.

    ``tokens``: (num_tokens,) uint32; ``chunks``: (key, bytes or None) of every complete
    chunk in order.
    """
    expected = chain_keys(spec.layout_id, tokens, spec.chunk_tokens)
    if len(chunks) != len(expected):
        raise InvalidRequest(f"{len(tokens)} tokens make {len(expected)} chunks of "
                             f"{spec.chunk_tokens}; {len(chunks)} were given")
    for i, item in enumerate(chunks):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidRequest(f"chunk {i} must be a (key, bytes or None) pair")
        key, data = item
        if key != expected[i]:
            raise InvalidRequest(f"chunk {i} has key {key!r}; its tokens under layout "
                                 f"{spec.layout_id} chain to {expected[i]!r}")
        if data is not None:
            as_request_error(restored_chunk_check(spec, tokens, i), data)
    if len(tail):
        _check_tail(spec, tokens, len(chunks) * spec.chunk_tokens, tail)
    if window is not None:
        as_request_error(window_check(spec, tokens), window)


def as_request_error(check: Callable[[Buffer], None], data: Buffer) -> None:
    """Run a restore-side check on spilled bytes: a mismatch is the caller's error (the
    ``InvalidRequest`` behind it), not a corrupt copy in a tier."""
    try:
        check(data)
    except ChunkCorrupt as exc:
        if isinstance(exc.__cause__, InvalidRequest):
            raise exc.__cause__ from None
        raise


def _check_tail(spec: LayoutSpec, tokens: np.ndarray, covered: int, tail: Buffer) -> None:
    header = verify_chunk(tail)
    if header.ephemeral:
        raise InvalidRequest("the tail holds ephemeral (window) streams")
    if header.layout_hash != spec.layout_hash:
        raise LayoutMismatch(f"the tail belongs to layout {header.layout_hash:016x}, "
                             f"not {spec.layout_id}")
    if header.start_token != covered or not 0 < header.num_tokens <= len(tokens) - covered:
        raise InvalidRequest(f"the tail covers tokens {header.start_token}+{header.num_tokens}; "
                             f"{len(tokens) - covered} follow the last chunk at {covered}")
    if header.tokens_hash != tokens_hash(tokens[covered:covered + header.num_tokens]):
        raise LayoutMismatch("the tail was encoded for other token ids")
