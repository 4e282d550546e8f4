"""The engine's K/V values <-> a stream's stored codes (``layout.value_stream``).

Values: (layers, tokens, H, D) in the engine's KV dtype. A bf16 stream holds bf16 values
as they are (the codes are the values); an int8 stream holds ``kvstore.format.hf.quant``'s
symmetric codes, one fp16 scale per token and head.
"""

from __future__ import annotations

import torch

from kvstore.format.chunk import StreamData
from kvstore.format.errors import ChunkCorrupt, LayoutMismatch
from kvstore.format.hf.quant import decode_values, encode_values
from kvstore.format.layout import Stream


def encode(stream: Stream, values: torch.Tensor) -> StreamData:
    """``stream``'s codes of ``values`` (layers, tokens, H, D)."""
    if stream.bits == 16:
        if values.dtype != torch.bfloat16:
            raise LayoutMismatch(f"stream {stream.name} holds bf16 values, got {values.dtype}")
        return StreamData(values.contiguous(), None)
    return encode_values(stream, values)


def decode(stream: Stream, data: StreamData, dtype: torch.dtype) -> torch.Tensor:
    """(layers, tokens, H, D) values in ``dtype`` of a chunk's decoded stream."""
    if tuple(data.codes.shape[2:]) != stream.codes_shape or data.codes.shape[0] != stream.layers:
        raise ChunkCorrupt(f"stream {stream.name}: decoded codes {tuple(data.codes.shape)} do "
                           f"not fit ({stream.layers}, tokens, *{stream.codes_shape})")
    if stream.bits == 16:
        return data.codes.to(dtype)
    return decode_values(stream, data).to(dtype)
