"""Model tensors <-> a stream's stored codes, as docs/wire-format.md section 2.3 defines
them: symmetric per-group int4 / int8 with fp16 scales, or bf16.

    data = encode_values(stream, x)     # x float (layers, entries, *entry_shape)
    x = decode_values(stream, data)     # float32, same shape

Codes (layers, entries, *codes_shape): uint8 (int4, value 2i in the low nibble), int8 or
bfloat16; scales (layers, entries, groups) fp16, None for bf16.
"""

from __future__ import annotations

import torch

from kvstore.format.chunk import StreamData
from kvstore.format.errors import InvalidRequest
from kvstore.format.layout import Stream

QMAX = {4: 7, 8: 127}


def encode_values(stream: Stream, x: torch.Tensor) -> StreamData:
    """Quantize (layers, entries, *entry_shape) values as ``stream`` stores them."""
    if tuple(x.shape[2:]) != stream.entry_shape or x.shape[0] != stream.layers:
        raise InvalidRequest(f"stream {stream.name}: values must be (layers={stream.layers}, "
                             f"entries, *{stream.entry_shape}), got {tuple(x.shape)}")
    if stream.bits == 16:
        return StreamData(x.detach().to(torch.bfloat16).contiguous(), None)
    layers, entries = x.shape[:2]
    groups = x.detach().float().reshape(layers, entries, -1, stream.group_size)
    # the scale is rounded to fp16 first, so the codes are chosen for the stored scale
    scales = (groups.abs().amax(-1) / QMAX[stream.bits]).to(torch.float16)
    if not torch.isfinite(scales).all():
        raise InvalidRequest(f"stream {stream.name}: values beyond fp16 scale range or not "
                             "finite")
    s = scales.float().unsqueeze(-1)
    codes = torch.where(s > 0, torch.round(groups / torch.where(s > 0, s, 1.0)), 0.0)
    codes = codes.clamp(-QMAX[stream.bits] - (stream.bits == 4), QMAX[stream.bits])
    codes = codes.to(torch.int8).reshape(layers, entries, *stream.entry_shape)
    if stream.bits == 4:
        nibbles = codes.to(torch.int16) & 0xF
        codes = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)
    return StreamData(codes.contiguous(), scales.reshape(layers, entries, -1).contiguous())


def decode_values(stream: Stream, data: StreamData) -> torch.Tensor:
    """float32 (layers, entries, *entry_shape) from a stream's stored codes."""
    if stream.bits == 16:
        return data.codes.float()
    codes = data.codes
    if stream.bits == 4:
        packed = codes.to(torch.int16)
        lo, hi = packed & 0xF, (packed >> 4) & 0xF
        lo, hi = lo - ((lo & 8) << 1), hi - ((hi & 8) << 1)  # sign-extend the nibbles
        codes = torch.stack((lo, hi), dim=-1).reshape(*codes.shape[:-1], -1)
    layers, entries = codes.shape[:2]
    groups = codes.float().reshape(layers, entries, -1, stream.group_size)
    values = groups * data.scales.float().reshape(layers, entries, -1, 1)
    return values.reshape(layers, entries, *stream.entry_shape)
