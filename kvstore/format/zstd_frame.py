"""A chunk's zstd payload: one frame that must declare its content size, checked before
anything is decompressed (docs/wire-format.md section 2.4)."""

from __future__ import annotations

import numpy as np
import zstandard

from kvstore.format.errors import ChunkCorrupt

Buffer = bytes | bytearray | memoryview | np.ndarray  # a payload as stored


def decompressed(stored: Buffer, raw_len: int) -> np.ndarray:
    """A zstd payload's ``raw_len`` bytes as a fresh, writable array, its declared size
    checked before anything is allocated."""
    check_frame(stored, raw_len)
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            stored, max_output_size=raw_len)  # type: ignore[arg-type]  # numpy declares its buffer protocol for 3.12+ only
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(f"zstd payload does not decompress: {exc}") from exc
    if len(raw) != raw_len:
        raise ChunkCorrupt(f"zstd payload is {len(raw)} bytes, header says {raw_len}")
    return np.frombuffer(bytearray(raw), np.uint8)


def check_frame(stored: Buffer, raw_len: int) -> None:
    """A zstd payload must declare exactly the raw length its header says; checked before
    decompressing (a frame that declares a size is decompressed into a buffer of that
    size, whatever ``max_output_size`` says), so nothing larger is ever allocated."""
    try:
        declared = zstandard.frame_content_size(stored)  # type: ignore[arg-type]  # numpy declares its buffer protocol for 3.12+ only
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(f"zstd payload has no valid frame header: {exc}") from exc
    if declared < 0:
        raise ChunkCorrupt("zstd payload does not declare its content size")
    if declared != raw_len:
        raise ChunkCorrupt(f"zstd payload declares {declared} bytes, header says {raw_len}")
