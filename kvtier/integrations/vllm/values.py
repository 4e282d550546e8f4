"""The engine's K/V values <-> a stream's stored codes (``layout.value_stream``).

Values: (layers, tokens, H, D) in the engine's KV dtype. A bf16 or fp16 stream holds
values of its own dtype as they are (the codes are the values; another dtype is refused,
never rounded); int8 and fp8 streams hold ``kvstore.format.hf.quant``'s codes (int8: one
fp16 scale per token and head; fp8: one float32 scale per layer, made from the chunk's
absmax).

A page stream (``layout.page_layout``, ``layout.raw_layout``) holds no values: it is given
the engine's pages, (layers, blocks, page bytes) uint8 (``PagedLayout.as_pages``), and its
codes are those bytes, one entry per block (a partial block is given none).
"""

from __future__ import annotations

import torch

from kvstore.format.chunk import StreamData
from kvstore.format.chunk_parts import code_dtype
from kvstore.format.errors import ChunkCorrupt, InvalidRequest, LayoutMismatch
from kvstore.format.hf.quant import decode_values, encode_values
from kvstore.format.layout import Stream


def encode(stream: Stream, values: torch.Tensor) -> StreamData:
    """``stream``'s codes of ``values`` (layers, tokens, H, D), or of pages (layers,
    blocks, page bytes)."""
    if stream.format == "page":
        if values.dtype != torch.uint8 or values.dim() != 3 \
                or values.shape[2] != stream.bytes_per_entry:
            raise LayoutMismatch(f"stream {stream.name} holds pages of "
                                 f"{stream.bytes_per_entry} B (uint8), got "
                                 f"{tuple(values.shape)} {values.dtype}")
        codes = values.reshape(*values.shape[:2], *stream.entry_shape)
        return StreamData(codes.contiguous(), None)
    if stream.value_format.scales == "none" and values.dtype != code_dtype(stream):
        raise LayoutMismatch(f"stream {stream.name} holds {stream.format} values as they are, "
                             f"got {values.dtype}")
    return encode_values(stream, values)


def decode(stream: Stream, data: StreamData, dtype: torch.dtype) -> torch.Tensor:
    """(layers, tokens, H, D) values in ``dtype`` of one chunk's decoded stream; a page
    stream's pages (layers, blocks, page bytes) uint8."""
    if stream.format == "page":
        return data.codes.reshape(data.codes.shape[0], -1, stream.bytes_per_entry)
    if stream.value_format.scales == "none" and dtype == data.codes.dtype:
        return data.codes
    try:
        return decode_values(stream, data).to(dtype)
    except InvalidRequest as exc:  # codes that do not fit the stream: not ours to use
        raise ChunkCorrupt(str(exc)) from exc
