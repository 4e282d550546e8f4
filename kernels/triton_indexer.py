"""Triton lightning-indexer scoring over int4 index keys.

int4 dequantization is fused: each program unpacks one tile of index keys once and reuses it
for every indexer head. Scoring and selection are separate kernels (selection: see
kernels/triton_topk.py), so the model can rescore inside a candidate pool between them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import arg_checks
from kernels.triton_quant import require_triton_device, unpack_nibbles


@triton.jit
def _indexer_scores_kernel(
        qi_ptr, kp_ptr, ks_ptr, w_ptr, nvis_ptr, out_ptr, T, HI, N,
        HALF: tl.constexpr, HALF_P2: tl.constexpr, GS: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    # qi (B, T, HI, 2*HALF) f32; kp (B, N, HALF) uint8; ks (B, N, 2*HALF/GS) fp16;
    # w (B, T, HI) f32; nvis (B, T) i64; out (B, T, N) f32.
    pid_n = tl.program_id(0)
    b = tl.program_id(2)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    bt = (b * T + t).to(tl.int64)
    nvis = tl.load(nvis_ptr + bt, mask=t_ok, other=0)
    out_offs = bt[:, None] * N + n[None, :]
    out_mask = t_ok[:, None] & n_ok[None, :]
    if pid_n * BLOCK_N >= tl.max(nvis, axis=0):
        # no query of this tile sees any of these entries (the causal corner): skip the maths
        tl.store(out_ptr + out_offs, tl.full([BLOCK_T, BLOCK_N], float("-inf"), tl.float32),
                 mask=out_mask)
    else:
        j = tl.arange(0, HALF_P2)
        j_ok = j < HALF
        entry = b.to(tl.int64) * N + n
        kmask = n_ok[:, None] & j_ok[None, :]
        packed = tl.load(kp_ptr + entry[:, None] * HALF + j[None, :], mask=kmask, other=0)
        scale = tl.load(ks_ptr + entry[:, None] * (2 * HALF // GS) + (j // (GS // 2))[None, :],
                        mask=kmask, other=0.0).to(tl.float32)
        lo, hi = unpack_nibbles(packed)
        k_even = lo.to(tl.float32) * scale
        k_odd = hi.to(tl.float32) * scale
        qmask = t_ok[:, None] & j_ok[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for h in range(HI):
            q_offs = (bt * HI + h)[:, None] * (2 * HALF) + 2 * j[None, :]
            q_even = tl.load(qi_ptr + q_offs, mask=qmask, other=0.0).to(tl.float32)
            q_odd = tl.load(qi_ptr + q_offs + 1, mask=qmask, other=0.0).to(tl.float32)
            dots = (tl.dot(q_even, tl.trans(k_even), input_precision="ieee")
                    + tl.dot(q_odd, tl.trans(k_odd), input_precision="ieee"))
            w_h = tl.load(w_ptr + bt * HI + h, mask=t_ok, other=0.0).to(tl.float32)
            acc += w_h[:, None] * tl.maximum(dots, 0.0)
        visible = n[None, :] < nvis[:, None]
        tl.store(out_ptr + out_offs, tl.where(visible, acc, float("-inf")), mask=out_mask)


def indexer_launch(di: int, group_size: int) -> dict:
    """Constexprs of _indexer_scores_kernel: 16 x 32 tiles, as larger ones spill registers
    in an sm_90 build (fp32 FMA dots)."""
    half = di // 2
    return {"HALF": half, "HALF_P2": max(16, triton.next_power_of_2(half)), "GS": group_size,
            "BLOCK_T": 16, "BLOCK_N": 32}


def indexer_scores(qi, ki_packed, ki_scales, w, n_visible, group_size: int) -> torch.Tensor:
    """score[b,t,n] = sum_h w[b,t,h] * relu(qi[b,t,h] . dequant(ki)[b,n]), -inf for n >=
    n_visible[b,t]; see kernels.reference.indexer_scores.

    qi (B, T, Hi, Di) float; ki_packed (B, N, Di/2) uint8; ki_scales (B, N, Di/group_size)
    fp16; w (B, T, Hi) float; n_visible (T,) or (B, T) int64. Returns (B, T, N) float32.
    """
    b, t, hi, di, n = arg_checks.check_indexer_scores(qi, ki_packed, ki_scales, w, n_visible,
                                                  group_size)
    require_triton_device(qi=qi, ki_packed=ki_packed, ki_scales=ki_scales, w=w,
                          n_visible=n_visible)
    out = torch.full((b, t, n), float("-inf"), dtype=torch.float32, device=qi.device)
    if out.numel() == 0:
        return out
    launch = indexer_launch(di, group_size)
    grid = (triton.cdiv(n, launch["BLOCK_N"]), triton.cdiv(t, launch["BLOCK_T"]), b)
    _indexer_scores_kernel[grid](
        qi.contiguous(), ki_packed.contiguous(), ki_scales.contiguous(), w.contiguous(),
        n_visible.expand(b, t).contiguous(), out, t, hi, n, **launch)
    return out
