"""Chunks forged byte by byte for the fuzz and adversarial campaigns: a
header and section table of the attacker's choosing with every checksum right, so only
the layout can tell them apart from honest chunks (the format is ``kvstore/format/chunk.py``'s).

    bomb = zstd_bomb(spec, tokens, 512 << 20)        # ~20 KB that would expand to 512 MiB
    table = one_section_chunk(spec, tokens, honest)  # one zstd section instead of the layout's
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import xxhash
import zstandard

from kvstore.format.chunk import (
    FLAG_EPHEMERAL,
    FLAG_ZSTD,
    MAGIC,
    SECTION_DTYPE,
    VERSION,
    tokens_hash,
)
from kvstore.format.chunk_parts import chunk_plan
from kvstore.format.layout import LayoutSpec

HEADER = struct.Struct("<4sHHQQIIQQQ")  # the chunk header, as kvstore/format/chunk.py documents it
MiB = 1 << 20


def forge(spec: LayoutSpec, start: int, ids: np.ndarray, rows: list[tuple], raw_len: int,
          stored: bytes, *, flags: int = 0) -> bytes:
    """A chunk with the given section table (stream, layer, part, offset, length, xxh3)
    and stored payload; header and table checksums are right."""
    table = np.zeros(len(rows), SECTION_DTYPE)
    for i, (stream, layer, part, offset, length, checksum) in enumerate(rows):
        table[i] = (stream, layer, part, b"\0" * 3, offset, length, checksum)
    head = HEADER.pack(MAGIC, VERSION, flags, spec.layout_hash, start, len(ids), len(rows),
                       tokens_hash(ids), len(stored), raw_len) + table.tobytes()
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + stored


def honest_rows(spec: LayoutSpec, tokens: int, ephemeral: bool, names=None) -> list[tuple]:
    """The table encode_chunk writes for these streams, with the checksums of zeros."""
    plan = chunk_plan(spec, tokens, ephemeral, names)
    return [(ids & 0xFFFF, (ids >> 16) & 0xFFFF, ids >> 32, offset, length, zeros_xxh3(length))
            for ids, offset, length in plan.table_head.tolist()]


@functools.lru_cache(maxsize=16)
def zeros_xxh3(length: int) -> int:
    hasher, block = xxhash.xxh3_64(), bytes(MiB)
    for at in range(0, length, MiB):
        hasher.update(block[: min(MiB, length - at)])
    return hasher.intdigest()


@functools.lru_cache(maxsize=8)
def zeros_frame(length: int, declare: bool = True) -> bytes:
    """A zstd frame of ``length`` zero bytes, its content size declared or not."""
    frame = zstandard.ZstdCompressor(level=1, write_content_size=declare).compressobj(
        size=length if declare else -1)
    block, out = bytes(MiB), []
    for at in range(0, length, MiB):
        out.append(frame.compress(block[: min(MiB, length - at)]))
    out.append(frame.flush())
    return b"".join(out)


def one_section_chunk(spec: LayoutSpec, ids: np.ndarray, honest: bytes) -> bytes:
    """The honest chunk's payload as one zstd section: a table the layout does not have."""
    raw = honest[-chunk_plan(spec, len(ids), False).payload_bytes:]
    return forge(spec, 0, ids, [(0, 0, 0, 0, len(raw), xxhash.xxh3_64_intdigest(raw))],
                 len(raw), zstandard.ZstdCompressor().compress(raw), flags=FLAG_ZSTD)


def table_bomb(spec: LayoutSpec, ids: np.ndarray, size: int, declare: bool = True) -> bytes:
    """One section claiming ``size`` raw bytes, in a small zstd frame of zeros."""
    return forge(spec, 0, ids, [(0, 0, 0, 0, size, zeros_xxh3(size))], size,
                 zeros_frame(size, declare), flags=FLAG_ZSTD)


def frame_bomb(spec: LayoutSpec, ids: np.ndarray, size: int, declare: bool = True) -> bytes:
    """The layout's own table over a zstd frame that holds ``size`` bytes."""
    plan = chunk_plan(spec, len(ids), False)
    return forge(spec, 0, ids, honest_rows(spec, len(ids), False), plan.payload_bytes,
                 zeros_frame(size, declare), flags=FLAG_ZSTD)


def window_bomb(spec: LayoutSpec, ids: np.ndarray) -> bytes:
    """A window part claiming every token of the session (its window K/V in zeros)."""
    names = tuple(s.name for s in spec.ephemeral_streams if not s.pending)
    raw = chunk_plan(spec, len(ids), True, names).payload_bytes
    return forge(spec, 0, ids, honest_rows(spec, len(ids), True, names), raw,
                 zeros_frame(raw, True), flags=FLAG_ZSTD | FLAG_EPHEMERAL)
