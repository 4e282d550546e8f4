"""Checks that spilled and restored bytes are what a session's manifest says they are.

Pending rows (the ephemeral streams marked ``pending``) are the tokens of a persistent
stream's unfinished entry: a window part that carries any covers ``n mod m`` tokens of an
``n``-token session, for ``m`` the ``tokens_per_entry`` of one of the persistent streams
(a layout whose persistent streams share one m: ``n mod m``), and ends at token ``n``.

A spill is refused whole (nothing stored) unless its token ids lie in the layout's
vocabulary and every chunk decodes cleanly, has exactly the section table the layout
gives its token count (so every size is known from the layout before anything is
decompressed), belongs to the session's layout, covers exactly its token range, and
carries the key that the token ids chain to, with the digest of its bytes: a wrong key
would let dedupe hand one session another's KV. On
restore the same facts are re-checked for every copy read, so a copy that passes its
own checksum but belongs elsewhere still counts as corrupt and is fallen through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kvstore.format.chunk import (
    VERSION,
    Buffer,
    ChunkHeader,
    max_encoded_bytes,
    read_header,
    split_chunks,
    tokens_hash,
    verify_chunk,
)
from kvstore.format.errors import ChunkCorrupt, InvalidRequest, LayoutMismatch, shown
from kvstore.format.keys import ROOT_PARENT, chunk_digest, chunk_key, split_block_key
from kvstore.format.layout import LayoutSpec, Stream


def check_token_ids(spec: LayoutSpec, tokens: np.ndarray) -> None:
    """Every id must lie in the layout's vocabulary: a model fed one outside it fails
    (an embedding lookup out of range) long after the spill was acknowledged."""
    if len(tokens) and int(tokens.max()) >= spec.vocab_size:
        at = int(np.argmax(tokens >= spec.vocab_size))
        raise InvalidRequest(f"token id {int(tokens[at])} at position {at} is outside the "
                             f"vocabulary of layout {spec.name}: ids must be < "
                             f"vocab_size {spec.vocab_size}")


def check_written_version(what: str, header: ChunkHeader) -> None:
    """The one chunk-version rule of every write that stores chunks (a Spill's chunks,
    tail and window; WriteChunks): only the current format version is accepted. Older
    ones are still read where stored (docs/wire-format.md 2.1), never taken in: a chunk
    taken in may be named by key later and sent to any reader of section 3."""
    if header.version != VERSION:
        raise InvalidRequest(f"{what} is in chunk format version {header.version}, which "
                             "this server still reads from storage but no longer accepts in "
                             f"a write (Spill, WriteChunks): encode format version {VERSION}")


def chunk_bytes_max(spec: LayoutSpec, num_tokens: int) -> int:
    """The most bytes a persistent chunk of ``num_tokens`` tokens can be encoded in."""
    return max_encoded_bytes(spec, num_tokens, False)


def window_bytes_max(spec: LayoutSpec) -> int:
    """The most bytes a window blob can take, whatever the session's length: the window
    K/V over at most W tokens, and the pending rows of at most m - 1 tokens."""
    window = tuple(s.name for s in spec.ephemeral_streams if not s.pending)
    pending = tuple(s.name for s in spec.ephemeral_streams if s.pending)
    total = max_encoded_bytes(spec, spec.window_tokens, True, window) if window else 0
    if pending:
        total += max_encoded_bytes(spec, spec.pending_tokens_max, True, pending)
    return total


def _check_range(
    what: str, header: ChunkHeader, spec: LayoutSpec, tokens: np.ndarray, start: int, count: int
) -> None:
    if header.layout_hash != spec.layout_hash:
        raise LayoutMismatch(f"{what} belongs to layout {header.layout_hash:016x}, "
                             f"not {spec.layout_id}")
    if header.start_token != start or header.num_tokens != count:
        raise InvalidRequest(f"{what} covers tokens {header.start_token}+{header.num_tokens}, "
                             f"expected {start}+{count}")
    if header.tokens_hash != tokens_hash(tokens[start : start + count]):
        raise LayoutMismatch(f"{what} was encoded for other token ids")


def check_spill(  # noqa: C901 - one check per part of a spill, in the format's order
    spec: LayoutSpec,
    tokens: np.ndarray,
    chunks: Sequence[tuple[str, Buffer | None]],
    tail: Buffer,
    window: Buffer | None,
    *,
    scope: str,
    model_fingerprint: str = "",
) -> None:
    """Raise ``InvalidRequest`` / ``LayoutMismatch`` / ``CodecError`` unless it all fits.

    ``tokens``: (num_tokens,) uint32. Every complete chunk of the token ids must be given,
    as (block key, bytes), or as (block key, None) for a chunk the store already holds.
    A block key is the chain key of the chunk's tokens (under ``scope``, the layout and
    ``model_fingerprint``) and the digest of its bytes (``kvstore.format.keys``): the chain part
    must be the one the tokens chain to, so a spill can only name chunks of its own
    tokens, model and domain; sent bytes must have the digest the key states, so a named
    chunk is the very bytes its spiller sent. The tail covers the rest (tokens of an
    incomplete entry may stay uncovered).
    """
    check_token_ids(spec, tokens)
    if spec.requires_model_fingerprint and not model_fingerprint:
        raise InvalidRequest(f"layout {spec.layout_id} requires a model fingerprint "
                             "(the weights/version id of the model whose KV this is)")
    size = spec.chunk_tokens
    if len(chunks) != len(tokens) // size:
        raise InvalidRequest(f"{len(tokens)} tokens make {len(tokens) // size} chunks of "
                             f"{size}; {len(chunks)} were given")
    parent = ROOT_PARENT
    for i, item in enumerate(chunks):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidRequest(f"chunk {i} must be a (block key, bytes or None) pair")
        key, data = item
        chain, digest = split_block_key(key)
        parent = chunk_key(scope, spec.layout_id, model_fingerprint, parent,
                           tokens[i * size : (i + 1) * size])
        if chain != parent:
            raise InvalidRequest(f"chunk {i} has key {shown(key)}; its tokens under layout "
                                 f"{spec.layout_id}, this model fingerprint and dedupe "
                                 f"domain chain to {parent!r}")
        if data is not None:
            check_chunk(spec, tokens, i, digest, data)
    covered = len(chunks) * size
    if len(tail):
        header = verify_chunk(tail, spec)
        check_written_version("the tail", header)
        if header.ephemeral:
            raise InvalidRequest("the tail holds ephemeral (window) streams")
        if not 0 < header.num_tokens <= len(tokens) - covered:
            raise InvalidRequest(f"the tail covers {header.num_tokens} tokens; "
                                 f"{len(tokens) - covered} follow the last chunk")
        _check_range("the tail", header, spec, tokens, covered, header.num_tokens)
    if window is not None:
        check_window(spec, tokens, window)


def check_chunk(spec: LayoutSpec, tokens: np.ndarray, index: int, digest: bytes,
                data: Buffer) -> None:
    """Sent bytes of chunk ``index`` of ``tokens``: a valid chunk of the layout (every
    checksum, the section table against the layout), of persistent streams, covering that
    chunk's tokens, with the stated ``digest``; else ``InvalidRequest`` / ``LayoutMismatch``
    / ``CodecError``."""
    header = verify_chunk(data, spec)
    check_written_version(f"chunk {index}", header)
    if header.ephemeral:
        raise InvalidRequest(f"chunk {index} holds ephemeral (window) streams")
    size = spec.chunk_tokens
    _check_range(f"chunk {index}", header, spec, tokens, index * size, size)
    if chunk_digest(data) != digest:
        raise InvalidRequest(f"chunk {index}'s bytes do not have the digest its key states "
                             "(BLAKE2b-256 of the encoded chunk)")


def check_window(spec: LayoutSpec, tokens: np.ndarray, window: Buffer) -> None:
    """A window blob is one or more ephemeral chunks back to back (window K/V, pending rows
    of ``kvstore.format.window.pending_counts`` tokens), together no larger than the
    layout's window allows."""
    if len(window) > window_bytes_max(spec):
        raise InvalidRequest(f"the window blob is {len(window)} B; layout {spec.name} "
                             f"(W = {spec.window_tokens}) encodes one in at most "
                             f"{window_bytes_max(spec)} B")
    parts = split_chunks(window)
    if not parts:
        raise InvalidRequest("the window blob is empty")
    for part in parts:
        header = verify_chunk(part, spec)
        check_written_version("the window", header)
        if not header.ephemeral:
            raise InvalidRequest("the window blob must be encoded with ephemeral=True")
        if header.start_token + header.num_tokens > len(tokens):
            raise InvalidRequest("the window covers tokens beyond the session's end")
        _check_range("the window", header, spec, tokens, header.start_token, header.num_tokens)
        check_part(spec, len(tokens), header)


def restored_chunk_check(spec: LayoutSpec, tokens: np.ndarray, index: int,
                         key: str | None = None) -> Any:  # a check, .proven given a key
    """A ``TierStack.read`` check: the copy must be chunk ``index`` of these tokens and,
    given its block ``key``, have the digest the key states (a valid chunk of the same
    tokens with other bytes passes every codec checksum)."""
    start, size = index * spec.chunk_tokens, spec.chunk_tokens
    digest = None if key is None else split_block_key(key)[1]

    def check(data: Buffer) -> None:
        if digest is not None and chunk_digest(data) != digest:
            raise ChunkCorrupt(f"a copy of chunk {index} does not have the digest its key "
                               "states")
        proven(data)

    def proven(data: Buffer) -> None:
        """The check of a copy whose tier proved it has the key's digest."""
        try:
            # With the digest matching, every byte is one the spiller sent under this key
            # (BLAKE2b-256), which check_spill verified whole (checksums, section table
            # against the layout): checking them again would add nothing. What is left
            # is whether they are this session's chunk.
            header = verify_chunk(data, spec) if digest is None else read_header(data)
            if header.ephemeral:
                raise InvalidRequest("holds ephemeral streams")
            _check_range(f"chunk {index}", header, spec, tokens, start, size)
        except InvalidRequest as exc:
            raise ChunkCorrupt(f"a copy does not match the manifest: {exc}") from exc

    if digest is not None:  # a tier can only prove a digest the key states
        check.proven = proven  # type: ignore[attr-defined]
    return check


def window_check(spec: LayoutSpec, tokens: np.ndarray) -> Callable[[Buffer], None]:
    def check(data: Buffer) -> None:
        try:
            check_window(spec, tokens, data)
        except InvalidRequest as exc:
            raise ChunkCorrupt(f"the window copy does not match the manifest: {exc}") from exc

    return check


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
    check_pending(spec, num_tokens, header.num_tokens, streams)
    if any(s.pending for s in streams) and \
            header.start_token + header.num_tokens != num_tokens:
        raise InvalidRequest(f"pending rows cover tokens {header.start_token}+"
                             f"{header.num_tokens}; they must end at the session's last "
                             f"token ({num_tokens})")


def check_pending(spec: LayoutSpec, num_tokens: int, covered: int,
                  streams: Iterable[Stream]) -> None:
    """``InvalidRequest`` unless ``streams`` (of a window part over ``covered`` tokens)
    carry no pending rows, or a count of ``pending_counts``."""
    pending = [s.name for s in streams if s.pending]
    if pending and covered not in pending_counts(spec, num_tokens):
        ms = sorted({s.tokens_per_entry for s in spec.persistent_streams})
        raise InvalidRequest(f"pending rows {pending} cover {covered} tokens; a session of "
                             f"{num_tokens} tokens has {num_tokens} mod m of them for m in "
                             f"{ms} (layout {spec.name}), one of "
                             f"{sorted(pending_counts(spec, num_tokens))}")
