"""int4/int8 group quantization and int4 packing: reference semantics, and the Triton
kernels (run by Triton's CPU interpreter) bit-identical to the reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import interpret
from kernels import reference as ref

if not torch.cuda.is_available():
    interpret.enable()  # before anything imports triton compiled (see kernels/interpret.py)


@pytest.fixture(scope="module")
def tri():
    with interpret.triton_under_test() as triton_ops:
        yield triton_ops


@st.composite
def int4_arrays(draw):
    lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
    dim = 2 * draw(st.integers(1, 12))
    values = draw(st.lists(st.integers(-8, 7), min_size=dim * _prod(lead),
                           max_size=dim * _prod(lead)))
    return torch.tensor(values, dtype=torch.int8).reshape(*lead, dim)


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


@settings(max_examples=60, deadline=None)
@given(int4_arrays())
def test_pack_unpack_round_trip_is_exact(q):
    packed = ref.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (*q.shape[:-1], q.shape[-1] // 2)
    assert torch.equal(ref.unpack_int4(packed), q)


def test_nibble_layout_is_low_then_high_twos_complement():
    q = torch.tensor([1, -1, -8, 7, 0, -2], dtype=torch.int8)
    assert ref.pack_int4(q).tolist() == [0xF1, 0x78, 0xE0]


def test_every_byte_unpacks_and_repacks():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(ref.pack_int4(ref.unpack_int4(every)), every)


@pytest.mark.parametrize("quant,deq,qmax", [
    (ref.quantize_int4, ref.dequantize_int4, 7),
    (ref.quantize_int8, ref.dequantize_int8, 127),
])
def test_quantize_error_within_half_a_step(quant, deq, qmax):
    torch.manual_seed(1)
    x = torch.randn(6, 5, 48) * torch.logspace(-2, 2, 48)
    codes, scales = quant(x, 16)
    assert scales.dtype == torch.float16 and scales.shape == (6, 5, 3)
    y = deq(codes, scales, 16)
    assert y.dtype == torch.float32 and y.shape == x.shape
    step = scales.float().repeat_interleave(16, dim=-1)
    # fp16 rounding of the scale can push |x|/scale a hair past qmax, never past qmax + 0.5
    assert ((y - x).abs() <= step * 0.5 * (1 + 1e-3) + 1e-12).all()
    absmax = x.reshape(6, 5, 3, 16).abs().amax(-1)
    assert torch.allclose(scales.float(), absmax / qmax, rtol=2e-3)


@pytest.mark.parametrize("quant,deq", [(ref.quantize_int4, ref.dequantize_int4),
                                       (ref.quantize_int8, ref.dequantize_int8)])
def test_requantizing_what_a_reader_sees_is_lossless(quant, deq):
    torch.manual_seed(2)
    codes, scales = quant(torch.randn(4, 40), 8)
    again_codes, again_scales = quant(deq(codes, scales, 8), 8)
    assert torch.equal(again_codes, codes) and torch.equal(again_scales, scales)


def test_zero_group_gets_zero_scale_and_codes():
    x = torch.zeros(2, 32)
    x[1, 16:] = torch.linspace(-1, 1, 16)
    packed, scales = ref.quantize_int4(x, 16)
    assert scales[0].tolist() == [0.0, 0.0] and scales[1, 0].item() == 0.0
    assert torch.equal(ref.unpack_int4(packed)[:, :16], torch.zeros(2, 16, dtype=torch.int8))
    assert torch.equal(ref.dequantize_int4(packed, scales, 16)[:, :16], torch.zeros(2, 16))


def test_ties_round_half_to_even():
    # absmax 7 gives scale exactly 1, so x / scale lands on exact halves
    x = torch.tensor([[7.0, 2.5, -2.5, 1.5, 0.5, -0.5, 3.5, 6.5]])
    packed, scales = ref.quantize_int4(x, 8)
    assert scales.item() == 1.0
    assert ref.unpack_int4(packed).tolist() == [[7, 2, -2, 2, 0, 0, 4, 6]]


@pytest.mark.parametrize("shape,group", [
    ((3, 5, 48), 16), ((7, 24), 8), ((2, 64), 64), ((1, 2), 2), ((5, 6), 6), ((4, 40), 40),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_quantize_matches_reference_bit_for_bit(tri, shape, group, dtype):
    torch.manual_seed(3)
    x = (torch.randn(shape) * 3).to(dtype)
    x[0, ..., :group] = 0
    x[-1, ..., -group:] = torch.arange(group) - group / 2 + 0.5  # halves: ties
    for quant, deq in [("quantize_int4", "dequantize_int4"),
                       ("quantize_int8", "dequantize_int8")]:
        want = getattr(ref, quant)(x, group)
        got = getattr(tri, quant)(x, group)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), quant
        assert torch.equal(getattr(tri, deq)(*want, group), getattr(ref, deq)(*want, group))


def test_triton_int8_handles_odd_groups(tri):
    torch.manual_seed(4)
    x = torch.randn(3, 15)
    want, got = ref.quantize_int8(x, 5), tri.quantize_int8(x, 5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("shape", [(2,), (3, 48), (2, 3, 26)])
def test_triton_pack_unpack_match_reference(tri, shape):
    torch.manual_seed(5)
    q = torch.randint(-8, 8, shape, dtype=torch.int8)
    packed = tri.pack_int4(q)
    assert torch.equal(packed, ref.pack_int4(q))
    assert torch.equal(tri.unpack_int4(packed), q)


def test_non_contiguous_input_is_handled(tri):
    x = torch.randn(16, 6).t()  # (6, 16), not contiguous
    want, got = ref.quantize_int4(x, 8), tri.quantize_int4(x, 8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_empty_tensors(tri):
    for impl in (ref, tri):
        packed, scales = impl.quantize_int4(torch.empty(0, 16), 8)
        assert packed.shape == (0, 8) and scales.shape == (0, 2)
        assert impl.dequantize_int4(packed, scales, 8).shape == (0, 16)


@pytest.mark.parametrize("call,message", [
    (lambda m: m.pack_int4(torch.zeros(3, dtype=torch.int8)), "even"),
    (lambda m: m.pack_int4(torch.tensor([8, 0], dtype=torch.int8)), r"\[-8, 7\]"),
    (lambda m: m.pack_int4(torch.zeros(2, dtype=torch.int32)), "torch.int8"),
    (lambda m: m.unpack_int4(torch.zeros(2, dtype=torch.int8)), "torch.uint8"),
    (lambda m: m.quantize_int4(torch.zeros(2, 12), 8), "multiple of group_size"),
    (lambda m: m.quantize_int4(torch.zeros(2, 12), 3), "even"),
    (lambda m: m.quantize_int8(torch.zeros(2, 12), 0), "positive"),
    (lambda m: m.quantize_int8(torch.zeros(2, 12, dtype=torch.int32), 4), "x must be"),
    (lambda m: m.dequantize_int4(torch.zeros(2, 8, dtype=torch.uint8),
                                 torch.zeros(2, 3, dtype=torch.float16), 8), "scales must"),
    (lambda m: m.dequantize_int8(torch.zeros(2, 8, dtype=torch.int8),
                                 torch.zeros(2, 1, dtype=torch.float32), 8), "float16"),
])
def test_bad_input_is_rejected_by_both_backends(tri, call, message):
    for impl in (ref, tri):
        with pytest.raises(ValueError, match=message):
            call(impl)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 3), half=st.integers(1, 12),
       log_scale=st.floats(-6, 6), seed=st.integers(0, 2**16))
def test_triton_quantize_matches_reference_on_random_shapes(tri, rows, groups, half,
                                                            log_scale, seed):
    group = 2 * half
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups * group, generator=g) * 10.0 ** log_scale
    for quant in ("quantize_int4", "quantize_int8"):
        want, got = getattr(ref, quant)(x, group), getattr(tri, quant)(x, group)
        assert torch.equal(got[0], want[0]) and _same_scales(got[1], want[1]), quant


@pytest.mark.parametrize("quant,deq", [("quantize_int4", "dequantize_int4"),
                                       ("quantize_int8", "dequantize_int8")])
def test_unrepresentable_groups_dequantize_to_nan_on_both_backends(tri, quant, deq):
    x = torch.randn(4, 24)
    x[0, 3] = math.nan
    x[1, 9] = math.inf
    x[2, 16:] = 1e7  # absmax / qmax is past fp16's largest value
    x[3, :8] = 0.0
    for impl in (ref, tri):
        codes, scales = getattr(impl, quant)(x, 8)
        assert torch.equal(torch.isnan(scales), torch.tensor(
            [[True, False, False], [False, True, False], [False, False, True],
             [False, False, False]]))
        y = getattr(impl, deq)(codes, scales, 8)
        poisoned = torch.isnan(scales).repeat_interleave(8, dim=-1)
        assert torch.isnan(y[poisoned]).all()
        assert torch.isfinite(y[~poisoned]).all() and (y[3, :8] == 0).all()
    want, got = getattr(ref, quant)(x, 8), getattr(tri, quant)(x, 8)
    assert torch.equal(got[0], want[0]) and _same_scales(got[1], want[1])


def _same_scales(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal scales, NaN (an unrepresentable group) matching NaN."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(),
                                                                       b.nan_to_num())


def test_fp16_range_boundary_agrees_on_both_backends(tri):
    # absmax / 127 = 65519 still rounds to fp16's 65504; 65520 rounds to inf: unrepresentable
    x = torch.zeros(2, 4)
    x[0, 0], x[1, 0] = 65519.0 * 127, 65520.0 * 127
    for impl in (ref, tri):
        _, scales = impl.quantize_int8(x, 4)
        assert scales[0, 0].item() == 65504.0 and torch.isnan(scales[1, 0])
