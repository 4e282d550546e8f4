"""Triton kernels for int4/int8 group quantization and int4 packing.

Layouts match kernels/reference.py: a tensor (..., D) is treated as M = numel/group_size
contiguous groups; scales are fp16, one per group; int4 codes pack two per byte, element 2i
in the low nibble. The maths is chosen to be bit-identical to the reference: correctly
rounded fp32 division (div_rn, where `/` would be approximate on GPU), the scale rounded
to fp16 before the codes are computed, and round-half-to-even like torch.round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import arg_checks, backend

_BLOCK_ELEMS = 2048  # elements per program: small enough for registers, big enough for DRAM


def require_triton_device(**tensors: torch.Tensor) -> None:
    """Triton needs CUDA tensors, unless the interpreter runs the kernels on the CPU."""
    if backend.interpreting():
        return
    for name, t in tensors.items():
        if not t.is_cuda:
            raise ValueError(f"{name} is on {t.device}: the Triton kernels need CUDA tensors "
                             "(or TRITON_INTERPRET=1 to interpret them on the CPU)")


def _rows_per_program(group_elems: int) -> int:
    return max(1, min(256, triton.next_power_of_2(max(1, _BLOCK_ELEMS // group_elems))))


def int4_launch(group_size: int) -> dict:
    """Constexprs of the int4 (de)quantize kernels: groups of HALF byte pairs."""
    half = group_size // 2
    return {"HALF": half, "HALF_P2": triton.next_power_of_2(half),
            "BLOCK_M": _rows_per_program(group_size)}


def int8_launch(group_size: int) -> dict:
    """Constexprs of the int8 (de)quantize kernels."""
    return {"GS": group_size, "GS_P2": triton.next_power_of_2(group_size),
            "BLOCK_M": _rows_per_program(group_size)}


@triton.jit
def round_half_even(y):
    """torch.round semantics: y + 0.5 floored, then ties moved to the even neighbour."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _group_scale(absmax, QMAX: tl.constexpr):
    """fp16 scale absmax/QMAX per row; NaN (absmax NaN, inf, or beyond fp16's range) marks a
    group that cannot be represented, as in the reference."""
    scale = tl.math.div_rn(absmax, QMAX)
    # fp32 values from 65520 up round to inf in fp16 (round-to-nearest-even)
    return tl.where(scale < 65520.0, scale, float("nan")).to(tl.float16)


@triton.jit
def _abs_nan_as_inf(x):
    """|x| with NaN mapped to inf, so a row max sees it (tl.max may skip NaN)."""
    return tl.where(x == x, tl.abs(x), float("inf"))


@triton.jit
def _codes(x, scale, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """Codes for x (fp32) against per-row fp16-rounded scales (fp32 [rows, 1]); zero codes
    where the scale is zero or NaN."""
    usable = scale > 0.0
    y = tl.math.div_rn(tl.where(usable, x, 0.0), tl.where(usable, scale, 1.0))
    y = tl.where(usable, round_half_even(y), 0.0)
    return tl.minimum(tl.maximum(y, QMIN), QMAX)


@triton.jit
def _quantize_int4_kernel(x_ptr, packed_ptr, scale_ptr, M,
                          HALF: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    # x: (M, 2*HALF) float; packed: (M, HALF) uint8; scale: (M,) fp16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HALF_P2)
    mask = (rows[:, None] < M) & (cols[None, :] < HALF)
    base = rows[:, None].to(tl.int64) * (2 * HALF) + 2 * cols[None, :]
    even = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(x_ptr + base + 1, mask=mask, other=0.0).to(tl.float32)
    absmax = tl.maximum(tl.max(_abs_nan_as_inf(even), axis=1),
                        tl.max(_abs_nan_as_inf(odd), axis=1))
    scale16 = _group_scale(absmax, 7.0)
    scale = scale16.to(tl.float32)[:, None]
    lo = _codes(even, scale, -8.0, 7.0).to(tl.int32) & 0xF
    hi = _codes(odd, scale, -8.0, 7.0).to(tl.int32) & 0xF
    out = (lo | (hi << 4)).to(tl.uint8)
    tl.store(packed_ptr + rows[:, None].to(tl.int64) * HALF + cols[None, :], out, mask=mask)
    tl.store(scale_ptr + rows, scale16, mask=rows < M)


@triton.jit
def _quantize_int8_kernel(x_ptr, codes_ptr, scale_ptr, M,
                          GS: tl.constexpr, GS_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    # x: (M, GS) float; codes: (M, GS) int8; scale: (M,) fp16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, GS_P2)
    mask = (rows[:, None] < M) & (cols[None, :] < GS)
    offs = rows[:, None].to(tl.int64) * GS + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale16 = _group_scale(tl.max(_abs_nan_as_inf(x), axis=1), 127.0)
    codes = _codes(x, scale16.to(tl.float32)[:, None], -127.0, 127.0)
    tl.store(codes_ptr + offs, codes.to(tl.int8), mask=mask)
    tl.store(scale_ptr + rows, scale16, mask=rows < M)


@triton.jit
def unpack_nibbles(p):
    """uint8 bytes -> (low, high) sign-extended int4 codes as int32."""
    p = p.to(tl.int32)
    lo = p & 0xF
    hi = (p >> 4) & 0xF
    return lo - ((lo & 8) << 1), hi - ((hi & 8) << 1)


@triton.jit
def _dequantize_int4_kernel(packed_ptr, scale_ptr, out_ptr, M,
                            HALF: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    # packed: (M, HALF) uint8; scale: (M,) fp16; out: (M, 2*HALF) float32
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HALF_P2)
    mask = (rows[:, None] < M) & (cols[None, :] < HALF)
    p = tl.load(packed_ptr + rows[:, None].to(tl.int64) * HALF + cols[None, :], mask=mask,
                other=0)
    scale = tl.load(scale_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    lo, hi = unpack_nibbles(p)
    base = rows[:, None].to(tl.int64) * (2 * HALF) + 2 * cols[None, :]
    tl.store(out_ptr + base, lo.to(tl.float32) * scale, mask=mask)
    tl.store(out_ptr + base + 1, hi.to(tl.float32) * scale, mask=mask)


@triton.jit
def _dequantize_int8_kernel(codes_ptr, scale_ptr, out_ptr, M,
                            GS: tl.constexpr, GS_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    # codes: (M, GS) int8; scale: (M,) fp16; out: (M, GS) float32
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, GS_P2)
    mask = (rows[:, None] < M) & (cols[None, :] < GS)
    offs = rows[:, None].to(tl.int64) * GS + cols[None, :]
    codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offs, codes * scale, mask=mask)


@triton.jit
def _pack_int4_kernel(q_ptr, packed_ptr, P, BLOCK: tl.constexpr):
    # q: (2P,) int8 in [-8, 7]; packed: (P,) uint8
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    lo = tl.load(q_ptr + 2 * offs, mask=mask, other=0).to(tl.int32) & 0xF
    hi = tl.load(q_ptr + 2 * offs + 1, mask=mask, other=0).to(tl.int32) & 0xF
    tl.store(packed_ptr + offs, (lo | (hi << 4)).to(tl.uint8), mask=mask)


@triton.jit
def _unpack_int4_kernel(packed_ptr, q_ptr, P, BLOCK: tl.constexpr):
    # packed: (P,) uint8; q: (2P,) int8
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    lo, hi = unpack_nibbles(tl.load(packed_ptr + offs, mask=mask, other=0))
    tl.store(q_ptr + 2 * offs, lo.to(tl.int8), mask=mask)
    tl.store(q_ptr + 2 * offs + 1, hi.to(tl.int8), mask=mask)


# ---------------------------------------------------------------- wrappers


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(..., D) int8 in [-8, 7] -> (..., D/2) uint8; code 2i in the low nibble, 2i+1 high."""
    arg_checks.require_dtype("q", q, torch.int8)
    if q.dim() < 1 or q.shape[-1] % 2:
        raise ValueError(f"q last dimension must be even, got shape {tuple(q.shape)}")
    require_triton_device(q=q)
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("q values must lie in [-8, 7] to fit a 4-bit nibble")
    q = q.contiguous()
    packed = torch.empty((*q.shape[:-1], q.shape[-1] // 2), dtype=torch.uint8, device=q.device)
    n = packed.numel()
    if n:
        _pack_int4_kernel[(triton.cdiv(n, _BLOCK_ELEMS),)](q, packed, n, BLOCK=_BLOCK_ELEMS)
    return packed


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(..., D/2) uint8 -> (..., D) int8 in [-8, 7]."""
    arg_checks.require_dtype("packed", packed, torch.uint8)
    if packed.dim() < 1:
        raise ValueError("packed must have at least one dimension (..., D/2)")
    require_triton_device(packed=packed)
    packed = packed.contiguous()
    q = torch.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=torch.int8,
                    device=packed.device)
    n = packed.numel()
    if n:
        _unpack_int4_kernel[(triton.cdiv(n, _BLOCK_ELEMS),)](packed, q, n, BLOCK=_BLOCK_ELEMS)
    return q


def _launch_per_groups(kernel, launch: dict, groups: int, *tensors: torch.Tensor) -> None:
    """One program per BLOCK_M quantization groups; an empty tensor launches nothing."""
    if groups:
        kernel[(triton.cdiv(groups, launch["BLOCK_M"]),)](*tensors, groups, **launch)


def quantize_int4(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float (..., D) -> (packed uint8 (..., D/2), scales fp16 (..., D/group_size))."""
    groups = arg_checks.check_quantize(x, group_size, int4=True)
    require_triton_device(x=x)
    x = x.contiguous()
    packed = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], groups), dtype=torch.float16, device=x.device)
    _launch_per_groups(_quantize_int4_kernel, int4_launch(group_size), scales.numel(),
                       x, packed, scales)
    return packed, scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """packed uint8 (..., D/2), scales fp16 (..., D/group_size) -> float32 (..., D)."""
    dim = arg_checks.check_dequantize(packed, scales, group_size, int4=True)
    require_triton_device(packed=packed, scales=scales)
    packed, scales = packed.contiguous(), scales.contiguous()
    out = torch.empty((*packed.shape[:-1], dim), dtype=torch.float32, device=packed.device)
    _launch_per_groups(_dequantize_int4_kernel, int4_launch(group_size), scales.numel(),
                       packed, scales, out)
    return out


def quantize_int8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float (..., D) -> (codes int8 (..., D), scales fp16 (..., D/group_size))."""
    groups = arg_checks.check_quantize(x, group_size, int4=False)
    require_triton_device(x=x)
    x = x.contiguous()
    codes = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty((*x.shape[:-1], groups), dtype=torch.float16, device=x.device)
    _launch_per_groups(_quantize_int8_kernel, int8_launch(group_size), scales.numel(),
                       x, codes, scales)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """codes int8 (..., D), scales fp16 (..., D/group_size) -> float32 (..., D)."""
    arg_checks.check_dequantize(codes, scales, group_size, int4=False)
    require_triton_device(codes=codes, scales=scales)
    codes, scales = codes.contiguous(), scales.contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    _launch_per_groups(_dequantize_int8_kernel, int8_launch(group_size), scales.numel(),
                       codes, scales, out)
    return out
