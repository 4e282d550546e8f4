"""Chunk keys: hash(layout id, parent chunk key, the chunk's token ids).

Keys chain, so two sessions with the same prefix under the same layout produce the same
keys for the shared chunks, which is what dedupe relies on. A keyed cryptographic hash
(BLAKE2b) is used rather than xxh3 because chunks are shared across tenants of one
namespace: a crafted collision must not let one tenant's tokens read another's KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvstore.errors import InvalidRequest

KEY_BYTES = 16
ROOT_PARENT = ""  # the parent of a session's first chunk


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32, the one canonical encoding for hashing and storage."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidRequest(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise InvalidRequest("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


def chunk_key(layout_id: str, parent_key: str, token_ids: Sequence[int] | np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvtier-chunk")
    for part in (layout_id.encode(), parent_key.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    h.update(token_bytes(token_ids))
    return h.hexdigest()


def chain_keys(
    layout_id: str, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int
) -> list[str]:
    """Keys of the complete chunks of a token sequence, in order (a partial tail has none)."""
    if chunk_tokens <= 0:
        raise InvalidRequest(f"chunk_tokens must be positive, got {chunk_tokens}")
    ids = np.asarray(token_ids)
    keys: list[str] = []
    parent = ROOT_PARENT
    for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
        parent = chunk_key(layout_id, parent, ids[start : start + chunk_tokens])
        keys.append(parent)
    return keys
