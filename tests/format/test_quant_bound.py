"""The quantizer docs/wire-format.md section 2.3 states, and its error bound
|x - code * scale| <= max(scale / 2 * (1 + 2^-16), qmax * 2^-24), for the transformers
integration's (kvstore/format/hf/quant.py) and the bundled model's (kernels.reference)."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from kvstore.format.hf.quant import decode_values, encode_values
from kvstore.format.layout import Stream

QMAX = {4: 7, 8: 127}
QMIN = {4: -8, 8: -127}


def values(seed: int) -> torch.Tensor:
    """(groups, 32) float32: every magnitude from fp16-subnormal scales to large ones,
    exact ties (x / scale a half integer), zeros, and single outliers."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 32, generator=gen)
    magnitude = 2.0 ** torch.randint(-40, 7, (4096, 1), generator=gen).float()
    x = x * magnitude
    x[::97] = 0.0
    x[1::89, 0] *= 100.0
    ties = torch.randint(-14, 15, (256, 32), generator=gen).float() / 2
    ties[:, 0] = 7.0  # absmax 7 at qmax 7: scale 1, x / scale the half integers themselves
    return torch.cat([x, ties])


def bound(scales: torch.Tensor, bits: int) -> torch.Tensor:
    s = scales.float()
    return torch.maximum(s / 2 * (1 + 2.0 ** -16), torch.full_like(s, QMAX[bits] * 2.0 ** -24))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_reference_quantizer_keeps_the_stated_bound(bits):
    x = values(bits)
    quantize, dequantize = ((quantize_int4, dequantize_int4) if bits == 4
                            else (quantize_int8, dequantize_int8))
    codes, scales = quantize(x, 32)
    assert torch.equal(scales, (x.abs().amax(-1, keepdim=True) /
                                torch.full_like(scales, QMAX[bits], dtype=torch.float32)
                                ).to(torch.float16))
    error = (dequantize(codes, scales, 32) - x).abs()
    assert (error <= bound(scales, bits)).all()
    # half a step is reached (the ties), so the bound is not a loose one
    normal = (scales.float() >= 2.0 ** -14).squeeze(-1)
    assert (error / scales.float())[normal].max() >= 0.5


@pytest.mark.parametrize("bits", [4, 8])
def test_the_integration_quantizer_is_the_same_one(bits):
    x = values(10 + bits)
    stream = Stream("s", (32,), bits=bits, group_size=32, layers=1)
    data = encode_values(stream, x[None])
    quantize = quantize_int4 if bits == 4 else quantize_int8
    codes, scales = quantize(x, 32)
    assert torch.equal(data.codes[0], codes) and torch.equal(data.scales[0], scales)
    error = (decode_values(stream, data)[0] - x).abs()
    assert (error <= bound(scales, bits)).all()


def test_codes_stay_within_qmin_and_qmax_and_int4_reaches_minus_8_only_when_subnormal():
    x = values(3)
    for bits, quantize in ((4, quantize_int4), (8, quantize_int8)):
        stream = Stream("s", (32,), bits=bits, group_size=32, layers=1)
        data = encode_values(stream, x[None])
        packed, scales = quantize(x, 32)
        codes = (decode_values(stream, data)[0] / scales.float().repeat_interleave(32, -1)
                 ).nan_to_num(0.0).round()
        assert codes.min() >= QMIN[bits] and codes.max() <= QMAX[bits]
        if bits == 4:
            low = (codes == -8).any(-1)
            assert (scales[low].float() < 2.0 ** -14).all()
