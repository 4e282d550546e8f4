"""Chunk identity: chain keys (what a chunk is *for*) and digests (what its bytes *are*).

A chain key names the chunk of a token sequence in one dedupe domain::

    chunk_key = BLAKE2b-128(person="kvtier-chunk-v2",
                            u32 len + scope, u32 len + layout id,
                            u32 len + model fingerprint, u32 len + parent key,
                            token ids as little-endian uint32)

with every length little-endian. ``scope`` is the dedupe domain: ``tenant:<tenant>`` by
default, ``shared:<name>`` for a domain the server configures for several tenants (a
public system prompt). The model fingerprint is the weights/version id the client
states: the layout id alone cannot tell a base model from its fine-tune. Keys chain
(the parent of a session's first chunk is ``ROOT_PARENT``), so two sessions with the
same prefix, layout, model and domain produce the same keys for the shared chunks.

A chain key says which bytes a chunk *should* hold, not which it does: every chunk also
carries a digest of its encoded bytes (BLAKE2b-256; xxh3 is not collision resistant
against an adversary), and it is stored under its *block key*, chain key and digest
together. Two spills of different bytes for one chain key therefore never share
storage, a dedupe is a byte-for-byte match, and a restore can check every byte against
the digest the spiller stated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from kvstore.format.errors import InvalidRequest, shown

KEY_BYTES = 16
DIGEST_BYTES = 32
ROOT_PARENT = ""  # the parent of a session's first chunk
MAX_FINGERPRINT_BYTES = 256
MAX_INDEPENDENT_LOOKUP = 1 << 12  # chunks one Lookup of independent chunks asks about (~4 ms)
_KEY_PERSON = b"kvtier-chunk-v2"
_DIGEST_PERSON = b"kvtier-bytes-v1"
_BLOCK_SEP = "."  # block key: "<chain key hex>.<digest hex>"


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32, the one canonical encoding for hashing and storage."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidRequest(f"token ids must be one-dimensional, got shape {arr.shape}")
    fits = arr.dtype.kind == "u" and arr.dtype.itemsize <= 4  # by its type: no scan
    if arr.size and not fits and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise InvalidRequest("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


def dedupe_scope(tenant: str, shared_domain: str | None = None) -> str:
    """The dedupe domain a chunk key binds: the tenant's own, or a shared one by name.

    The prefixes keep the two namespaces apart (a shared domain named like a tenant is
    still another domain); whether a tenant may use a shared domain is the server's
    configuration, checked before a key is ever computed for it."""
    return f"shared:{shared_domain}" if shared_domain else f"tenant:{tenant}"


def shared_domain(scope: str) -> str:
    """The shared domain's name a scope stands for; "" for a tenant's own."""
    return scope.removeprefix("shared:") if scope.startswith("shared:") else ""


def check_fingerprint(model_fingerprint: object) -> str:
    if not isinstance(model_fingerprint, str):
        raise InvalidRequest(f"model_fingerprint must be a string, got {shown(model_fingerprint)}")
    if len(model_fingerprint.encode()) > MAX_FINGERPRINT_BYTES:
        raise InvalidRequest(f"model_fingerprint is longer than {MAX_FINGERPRINT_BYTES} bytes")
    return model_fingerprint


def chunk_key(scope: str, layout_id: str, model_fingerprint: str, parent_key: str,
              token_ids: Sequence[int] | np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_KEY_PERSON)
    for part in (scope, layout_id, model_fingerprint, parent_key):
        raw = part.encode()
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    h.update(token_bytes(token_ids))
    return h.hexdigest()


def chain_keys(layout_id: str, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int, *,
               scope: str, model_fingerprint: str = "") -> list[str]:
    """Keys of the complete chunks of a token sequence, in order (a partial tail has none)."""
    return list(iter_chain_keys(layout_id, token_ids, chunk_tokens, scope=scope,
                                model_fingerprint=model_fingerprint))


def iter_chain_keys(layout_id: str, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int,
                    *, scope: str, model_fingerprint: str = "") -> Iterator[str]:
    """``chain_keys`` one at a time: a caller that stops early (a lookup at its first
    miss) hashes no further, whatever the length of the sequence it was sent."""
    if chunk_tokens <= 0:
        raise InvalidRequest(f"chunk_tokens must be positive, got {chunk_tokens}")
    ids = np.asarray(token_ids)
    parent = ROOT_PARENT
    for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
        parent = chunk_key(scope, layout_id, model_fingerprint, parent,
                           ids[start : start + chunk_tokens])
        yield parent


def independent_keys(layout_id: str, token_ids: Sequence[int] | np.ndarray,
                     chunk_tokens: int, *, scope: str, model_fingerprint: str = ""
                     ) -> list[str]:
    """Keys of the complete chunks of ``token_ids`` each keyed alone, as the first chunk of
    a sequence of its own tokens (proto "Independent chunks"): chunk i's key is the one
    ``chain_keys`` gives ``token_ids[i * chunk_tokens:(i + 1) * chunk_tokens]``."""
    if chunk_tokens <= 0:
        raise InvalidRequest(f"chunk_tokens must be positive, got {chunk_tokens}")
    ids = np.asarray(token_ids)
    return [chunk_key(scope, layout_id, model_fingerprint, ROOT_PARENT,
                      ids[start : start + chunk_tokens])
            for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens)]


def chunk_tokens_of(tokens: np.ndarray, index: int, chunk_tokens: int, independent: bool
                    ) -> tuple[np.ndarray, int]:
    """(the sequence chunk ``index`` of ``tokens`` belongs to, its index there): ``tokens``
    and ``index`` for a chained chunk; its own tokens and 0 for an independent one."""
    if not independent:
        return tokens, index
    return tokens[index * chunk_tokens:(index + 1) * chunk_tokens], 0


def chunk_digest(data: bytes | bytearray | memoryview) -> bytes:
    """BLAKE2b-256 of a chunk's encoded bytes (tail and window blobs alike)."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES, person=_DIGEST_PERSON).digest()


def block_key(chain: str, digest: bytes) -> str:
    """The storage key of the chunk ``chain`` whose bytes have ``digest``."""
    if len(digest) != DIGEST_BYTES:
        raise InvalidRequest(f"a chunk digest is {DIGEST_BYTES} bytes (BLAKE2b-256), "
                             f"got {len(digest)}")
    return f"{chain}{_BLOCK_SEP}{digest.hex()}"


def split_block_key(key: str) -> tuple[str, bytes]:
    """(chain key, digest) of a block key; ``InvalidRequest`` if it is not one."""
    chain, sep, digest = key.partition(_BLOCK_SEP)
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raw = b""
    if not sep or len(raw) != DIGEST_BYTES:
        raise InvalidRequest(f"{shown(key)} is not a block key (chain key '.' digest hex)")
    return chain, raw


def block_keys(layout_id: str, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int,
               chunks: Sequence[bytes | bytearray | memoryview], *, scope: str,
               model_fingerprint: str = "") -> list[str]:
    """The block keys of a session's encoded chunks (what ``TierManager.spill`` takes)."""
    chains = chain_keys(layout_id, token_ids, chunk_tokens, scope=scope,
                        model_fingerprint=model_fingerprint)
    if len(chains) != len(chunks):
        raise InvalidRequest(f"{len(token_ids)} tokens make {len(chains)} chunks of "
                             f"{chunk_tokens}; {len(chunks)} were given")
    return [block_key(c, chunk_digest(d)) for c, d in zip(chains, chunks, strict=True)]
