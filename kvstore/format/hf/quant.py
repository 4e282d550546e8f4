"""Model tensors <-> a stream's stored codes, as docs/wire-format.md sections 2.3 and 2.6
define them: symmetric per-group int4 / int8 with fp16 scales, bf16 or fp16 as they are,
or fp8 e4m3 with one float32 scale per layer.

    data = encode_values(stream, x)     # x float (layers, entries, *entry_shape)
    x = decode_values(stream, data)     # float32, same shape

Codes (layers, entries, *codes_shape): uint8 (int4, value 2i in the low nibble), int8,
bfloat16, float16 or float8_e4m3fn; scales (layers, entries, groups) fp16 for int4/int8,
(layers, chunks) float32 for fp8 (``StreamData``), None for bf16 and fp16.
"""

from __future__ import annotations

import torch

from kvstore.format.chunk import StreamData
from kvstore.format.chunk_parts import code_dtype, tensor_scale_fault
from kvstore.format.errors import InvalidRequest
from kvstore.format.layout import Stream

QMAX = {4: 7, 8: 127}
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def encode_values(stream: Stream, x: torch.Tensor, scale: float | torch.Tensor | None = None
                  ) -> StreamData:
    """Quantize (layers, entries, *entry_shape) values as ``stream`` stores them. An fp8
    stream takes ``scale``: a float or (layers,) float32, the engine's per-layer scale
    (vLLM's k_scale / v_scale), codes = x / scale saturated to +-448; None computes each
    layer's absmax / 448 (1 for an all-zero layer). Other formats take no ``scale``."""
    if tuple(x.shape[2:]) != stream.entry_shape or x.shape[0] != stream.layers:
        raise InvalidRequest(f"stream {stream.name}: values must be (layers={stream.layers}, "
                             f"entries, *{stream.entry_shape}), got {tuple(x.shape)}")
    if scale is not None and stream.format != "fp8_e4m3":
        raise InvalidRequest(f"stream {stream.name} is {stream.format}: only fp8 takes a scale")
    if stream.value_format.scales == "none":  # bf16 / fp16: the values themselves
        return StreamData(x.detach().to(code_dtype(stream)).contiguous(), None)
    if stream.format == "fp8_e4m3":
        return _encode_fp8(stream, x.detach().float(), scale)
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


def _encode_fp8(stream: Stream, x: torch.Tensor, scale: float | torch.Tensor | None
                ) -> StreamData:
    layers = stream.layers
    if not torch.isfinite(x).all():
        raise InvalidRequest(f"stream {stream.name}: fp8 values must be finite")
    if scale is None:
        amax = x.abs().reshape(layers, -1).amax(-1) if x.numel() else x.new_zeros(layers)
        scales = torch.where(amax > 0, amax / FP8_MAX, 1.0)
        if not torch.isfinite(scales).all() or not (scales > 0).all():
            raise InvalidRequest(f"stream {stream.name}: values too small or large for a "
                                 "float32 fp8 scale")
    else:
        scales = torch.as_tensor(scale, dtype=torch.float32).reshape(-1)
        if scales.numel() not in (1, layers):
            raise InvalidRequest(f"stream {stream.name}: one fp8 scale, or one per layer "
                                 f"({layers}), got {scales.numel()}")
        scales = scales.expand(layers)
    scales = scales.to(device="cpu", dtype=torch.float32).reshape(layers, 1).contiguous()
    fault = tensor_scale_fault(stream.name, scales.numpy())
    if fault:
        raise InvalidRequest(fault)
    shape = (layers,) + (1,) * (x.dim() - 1)
    codes = (x / scales.to(x.device).reshape(shape)).clamp(-FP8_MAX, FP8_MAX)
    return StreamData(codes.to(torch.float8_e4m3fn).contiguous(), scales)


def decode_values(stream: Stream, data: StreamData, chunk_tokens: int = 0) -> torch.Tensor:
    """float32 (layers, entries, *entry_shape) from a stream's stored codes. fp8 scales of
    more than one chunk (a session's, column c for tokens [c * chunk_tokens, (c + 1) *
    chunk_tokens)) need the layout's ``chunk_tokens``."""
    codes = data.codes
    want = (stream.layers, *codes.shape[1:2], *stream.codes_shape)
    if codes.dtype != code_dtype(stream) or tuple(codes.shape) != want:
        raise InvalidRequest(f"stream {stream.name}: codes must be {want} {code_dtype(stream)}, "
                             f"got {tuple(codes.shape)} {codes.dtype}")
    if stream.format == "page":
        raise InvalidRequest(f"stream {stream.name} holds an engine's own page bytes: they "
                             "are no values to decode")
    if stream.value_format.scales == "none":
        return codes.float()
    if data.scales is None:
        raise InvalidRequest(f"stream {stream.name}: its format has scales, none were given")
    if stream.format == "fp8_e4m3":
        return codes.float() * _entry_scales(stream, data.scales, codes.shape[1], chunk_tokens)
    if stream.bits == 4:
        packed = codes.to(torch.int16)
        lo, hi = packed & 0xF, (packed >> 4) & 0xF
        lo, hi = lo - ((lo & 8) << 1), hi - ((hi & 8) << 1)  # sign-extend the nibbles
        codes = torch.stack((lo, hi), dim=-1).reshape(*codes.shape[:-1], -1)
    layers, entries = codes.shape[:2]
    groups = codes.float().reshape(layers, entries, -1, stream.group_size)
    values = groups * data.scales.float().reshape(layers, entries, -1, 1)
    return values.reshape(layers, entries, *stream.entry_shape)


def _entry_scales(stream: Stream, scales: torch.Tensor | None, entries: int,
                  chunk_tokens: int) -> torch.Tensor:
    """(layers, entries, 1, ...) float32: each entry's chunk's scale."""
    columns = 0 if scales is None or scales.dim() != 2 else scales.shape[1]
    per_chunk = chunk_tokens // stream.tokens_per_entry
    if scales is None or scales.dtype != torch.float32 or scales.shape[0] != stream.layers \
            or columns < 1 or (columns > 1 and (per_chunk < 1 or columns * per_chunk < entries)):
        got = None if scales is None else (tuple(scales.shape), scales.dtype)
        raise InvalidRequest(f"stream {stream.name}: fp8 scales must be (layers, chunks) "
                             f"float32 covering {entries} entries (chunk_tokens "
                             f"{chunk_tokens}), got {got}")
    fault = tensor_scale_fault(stream.name, scales.detach().cpu().numpy())
    if fault:
        raise InvalidRequest(fault)
    if columns > 1:
        scales = scales.repeat_interleave(per_chunk, dim=1)[:, :entries]
    else:
        scales = scales.expand(stream.layers, entries)
    return scales.reshape(stream.layers, entries, *(1,) * len(stream.entry_shape))
