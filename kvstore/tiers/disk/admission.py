"""Admission of chunk records: the digest of a block is checked once, when it is written.

A value put under a block key (``kvstore.format.keys.block_key``: chain key and the
BLAKE2b-256 of the bytes) whose bytes have that digest is written as an ``ADMITTED``
record (``segments.py``); a value whose bytes do not (a sealed value, whose key names
the digest of the clear bytes) or under another key is written as a plain record. The
record's xxh3 covers its flags, key and value, and a read checks it against the index
entry, so an admitted record read back intact holds bytes with the digest its key
states: ``get_many_proven`` says so, and a restore skips recomputing the digest of
such a copy (``kvstore.placement.stack``). A compaction copies records verbatim, so
their mark travels with them.

The hashing of a put runs in a worker thread once it exceeds ``THREAD_BYTES``: both
BLAKE2b and xxh3 release the GIL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from kvstore.format.errors import InvalidRequest
from kvstore.format.keys import chunk_digest, split_block_key
from kvstore.tiers.base import Buffer
from kvstore.tiers.disk.segments import ADMITTED, encode_header, key_bytes, value_view

THREAD_BYTES = 1 << 18

# (key bytes, value view, record header, checksum) of one record to append
Prepared = tuple[bytes, memoryview, bytes, int]


def admitted(key: str, value: memoryview) -> bool:
    """Whether ``value`` has the digest the block key ``key`` states."""
    try:
        _, digest = split_block_key(key)
    except InvalidRequest:
        return False
    return chunk_digest(value) == digest


def prepare(items: Iterable[tuple[str, Buffer]]) -> list[Prepared]:
    """Each item's key and value checked and its record header made (blocking)."""
    out = []
    for key, value in items:
        kb, view = key_bytes(key), value_view(value)
        header, checksum = encode_header(kb, view, ADMITTED if admitted(key, view) else 0)
        out.append((kb, view, header, checksum))
    return out


async def prepared(items: Iterable[tuple[str, Buffer]]) -> list[Prepared]:
    """``prepare``, in a worker thread when the values are large."""
    items = list(items)
    size = sum(len(v) if isinstance(v, bytes | bytearray) else getattr(v, "nbytes", 0)
               for _, v in items)
    return await asyncio.to_thread(prepare, items) if size >= THREAD_BYTES else prepare(items)
