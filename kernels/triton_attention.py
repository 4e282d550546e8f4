"""Triton attention kernels over quantized KV, dequantizing inside the loop over keys.

Both kernels use the online softmax (running max, running denominator) in natural-log units
and return lse = log(sum exp(sm_scale * q.k)) so a caller can merge them with another
attention path; rows that see no key get out = 0 and lse = -inf. Dot products run in IEEE
fp32 (input_precision="ieee") so the Triton path agrees with the fp32 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import arg_checks
from kernels.triton_quant import require_triton_device, unpack_nibbles


@triton.jit
def _online_softmax_step(scores, m_i, l_i):
    """Folds one block of masked scores (-inf = hidden) into the running max / denominator.
    Returns (p, alpha, m_new, l_new); a row with nothing visible so far keeps p = 0."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _window_attention_kernel(
        q_ptr, kc_ptr, ks_ptr, vc_ptr, vs_ptr, qpos_ptr, kpos_ptr, out_ptr, lse_ptr,
        H, HKV, T, S, window, sm_scale,
        REP: tl.constexpr, DH: tl.constexpr, DH_P2: tl.constexpr, GS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    # q (B, H, T, DH) f32; kc/vc (B, HKV, S, DH) int8; ks/vs (B, HKV, S, DH/GS) fp16;
    # qpos (T,) i64; kpos (S,) i64; out (B, H, T, DH) f32; lse (B, H, T) f32.
    # One program: the REP query heads sharing one KV head, times a block of T, stacked as
    # rows, so the KV is read once per group and decode (T = 1) still fills the tile.
    pid_bk = tl.program_id(1)
    b = pid_bk // HKV
    hk = pid_bk % HKV
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < REP * T
    t = rows % T
    qrow = ((b * H + hk * REP + rows // T) * T + t).to(tl.int64)
    d = tl.arange(0, DH_P2)
    d_ok = d < DH
    q = tl.load(q_ptr + qrow[:, None] * DH + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    qpos = tl.load(qpos_ptr + t, mask=row_ok, other=0)
    kv_base = (b * HKV + hk).to(tl.int64) * S
    groups = DH // GS

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DH_P2], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < S
        kpos = tl.load(kpos_ptr + s, mask=s_ok, other=-1)
        kmask = s_ok[:, None] & d_ok[None, :]
        code_offs = (kv_base + s)[:, None] * DH + d[None, :]
        scale_offs = (kv_base + s)[:, None] * groups + (d // GS)[None, :]
        k = (tl.load(kc_ptr + code_offs, mask=kmask, other=0).to(tl.float32)
             * tl.load(ks_ptr + scale_offs, mask=kmask, other=0.0).to(tl.float32))
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        delta = qpos[:, None] - kpos[None, :]
        visible = (delta >= 0) & (delta < window) & (kpos >= 0)[None, :] & s_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax_step(scores, m_i, l_i)
        v = (tl.load(vc_ptr + code_offs, mask=kmask, other=0).to(tl.float32)
             * tl.load(vs_ptr + scale_offs, mask=kmask, other=0.0).to(tl.float32))
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(out_ptr + qrow[:, None] * DH + d[None, :], acc / l_safe[:, None],
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + qrow, tl.where(seen, m_i + tl.log(l_safe), float("-inf")), mask=row_ok)


@triton.jit
def _sparse_attention_kernel(
        q_ptr, kv_ptr, sc_ptr, idx_ptr, out_ptr, lse_ptr,
        H, T, N, K, K_SPLIT, sm_scale,
        out_sb, out_st, out_ss, out_sh, lse_sb, lse_st, lse_ss, lse_sh,
        HALF: tl.constexpr, HALF_P2: tl.constexpr, GS: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    # q (B, H, T, 2*HALF) f32; kv (B, N, HALF) uint8 int4 pairs; sc (B, N, 2*HALF/GS) fp16;
    # idx (B, T, K) i32; out[b, t, split, h, :] f32 and lse[b, t, split, h] f32 at the given
    # element strides (the final (B, H, T, ...) tensors when there is one split).
    # One program per (b, t, split): all heads share the query's selected entries; a split
    # covers K_SPLIT of them, so a decode step (B*T small) still fills the GPU. The latent is
    # handled as its even and odd halves (the low and high nibbles of each byte), so the
    # unpacked entry is never interleaved back in registers.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // T
    t = pid % T
    h = tl.arange(0, BLOCK_H)
    h_ok = h < H
    j = tl.arange(0, HALF_P2)
    j_ok = j < HALF
    qmask = h_ok[:, None] & j_ok[None, :]
    q_offs = ((b * H + h) * T + t).to(tl.int64)[:, None] * (2 * HALF) + 2 * j[None, :]
    q_even = tl.load(q_ptr + q_offs, mask=qmask, other=0.0).to(tl.float32)
    q_odd = tl.load(q_ptr + q_offs + 1, mask=qmask, other=0.0).to(tl.float32)
    groups = 2 * HALF // GS
    k_start = split * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_even = tl.zeros([BLOCK_H, HALF_P2], tl.float32)
    acc_odd = tl.zeros([BLOCK_H, HALF_P2], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        ids = tl.load(idx_ptr + pid.to(tl.int64) * K + kk, mask=kk < k_end, other=-1)
        used = ids >= 0
        entry = b.to(tl.int64) * N + tl.maximum(ids, 0)
        emask = used[:, None] & j_ok[None, :]
        packed = tl.load(kv_ptr + entry[:, None] * HALF + j[None, :], mask=emask, other=0)
        scale = tl.load(sc_ptr + entry[:, None] * groups + (j // (GS // 2))[None, :],
                        mask=emask, other=0.0).to(tl.float32)
        lo, hi = unpack_nibbles(packed)
        k_even = lo.to(tl.float32) * scale
        k_odd = hi.to(tl.float32) * scale
        scores = (tl.dot(q_even, tl.trans(k_even), input_precision="ieee")
                  + tl.dot(q_odd, tl.trans(k_odd), input_precision="ieee")) * sm_scale
        scores = tl.where(used[None, :], scores, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax_step(scores, m_i, l_i)
        acc_even = acc_even * alpha[:, None] + tl.dot(p, k_even, input_precision="ieee")
        acc_odd = acc_odd * alpha[:, None] + tl.dot(p, k_odd, input_precision="ieee")

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    row = b.to(tl.int64) * out_sb + t * out_st + split * out_ss + h * out_sh
    out_offs = row[:, None] + 2 * j[None, :]
    tl.store(out_ptr + out_offs, acc_even / l_safe[:, None], mask=qmask)
    tl.store(out_ptr + out_offs + 1, acc_odd / l_safe[:, None], mask=qmask)
    lse_offs = b.to(tl.int64) * lse_sb + t * lse_st + split * lse_ss + h * lse_sh
    tl.store(lse_ptr + lse_offs, tl.where(seen, m_i + tl.log(l_safe), float("-inf")),
             mask=h_ok)


def _tile(n: int, lo: int, hi: int) -> int:
    """Power-of-two tile covering n, at least `lo` (tl.dot needs 16) and at most `hi`."""
    return max(lo, min(hi, triton.next_power_of_2(max(1, n))))


def window_launch(rep: int, t: int, dh: int, group_size: int) -> dict:
    """Constexprs and num_warps of _window_attention_kernel for REP stacked heads x T rows.

    Tiles picked from ptxas spill reports of an sm_90 build (fp32 FMA dots are register
    hungry): a decode-sized row block streams wider key blocks, a replay-sized one narrower.
    """
    block_m = 16 if rep * t <= 16 else 32
    return {"REP": rep, "DH": dh, "DH_P2": _tile(dh, 16, 1 << 16), "GS": group_size,
            "BLOCK_M": block_m, "BLOCK_S": 32 if block_m == 16 else 16, "num_warps": 8}


def sparse_launch(h: int, dc: int, group_size: int) -> dict:
    """Constexprs and num_warps of _sparse_attention_kernel. The two dequantized
    [BLOCK_K, Dc/2] halves live in registers: narrower key blocks for wider latents."""
    half_p2 = _tile(dc // 2, 16, 1 << 16)
    return {"HALF": dc // 2, "HALF_P2": half_p2, "GS": group_size,
            "BLOCK_H": _tile(h, 16, 1 << 16),
            "BLOCK_K": 16 if half_p2 >= 256 else 32 if half_p2 == 128 else 64,
            "num_warps": 8 if half_p2 >= 256 else 4}


def sparse_splits(rows: int, k: int, block_k: int, device: torch.device) -> int:
    """How many slices of the K selected entries each query's work is cut into: enough
    programs to cover the GPU twice over when B*T is small (decode), never a slice shorter
    than two key blocks. The interpreter gets a nominal 4 "processors" so tests split too."""
    processors = (torch.cuda.get_device_properties(device).multi_processor_count
                  if device.type == "cuda" else 4)
    most = max(1, triton.cdiv(k, 2 * block_k))
    return max(1, min(most, triton.cdiv(2 * processors, max(1, rows))))


def window_attention(q, k_codes, k_scales, v_codes, v_scales, q_pos, k_pos, window: int,
                     group_size: int, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window attention over 8-bit KV; see kernels.reference.window_attention.

    q (B, H, T, Dh) float; k/v codes (B, Hkv, S, Dh) int8; k/v scales (B, Hkv, S,
    Dh/group_size) fp16; q_pos (T,) int64; k_pos (S,) int64. Returns out (B, H, T, Dh)
    float32 and lse (B, H, T) float32.
    """
    b, h, t, dh, hkv, s = arg_checks.check_window_attention(
        q, k_codes, k_scales, v_codes, v_scales, q_pos, k_pos, window, group_size, sm_scale)
    require_triton_device(q=q, k_codes=k_codes, k_scales=k_scales, v_codes=v_codes,
                          v_scales=v_scales, q_pos=q_pos, k_pos=k_pos)
    out = torch.zeros((b, h, t, dh), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, t), float("-inf"), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or s == 0:
        return out, lse
    rep = h // hkv
    launch = window_launch(rep, t, dh, group_size)
    grid = (triton.cdiv(rep * t, launch["BLOCK_M"]), b * hkv)
    _window_attention_kernel[grid](
        q.contiguous(), k_codes.contiguous(), k_scales.contiguous(), v_codes.contiguous(),
        v_scales.contiguous(), q_pos.contiguous(), k_pos.contiguous(), out, lse,
        h, hkv, t, s, int(window), float(sm_scale), **launch)
    return out, lse


def sparse_compressed_attention(q, kv_packed, kv_scales, idx, group_size: int,
                                sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention over selected int4 entries; see the reference of the same name.

    q (B, H, T, Dc) float; kv_packed (B, N, Dc/2) uint8; kv_scales (B, N, Dc/group_size)
    fp16; idx (B, T, K) int32 (-1 unused). Returns out (B, H, T, Dc) float32, lse (B, H, T).
    """
    b, h, t, dc, n, k = arg_checks.check_sparse_attention(
        q, kv_packed, kv_scales, idx, group_size, sm_scale)
    require_triton_device(q=q, kv_packed=kv_packed, kv_scales=kv_scales, idx=idx)
    out = torch.zeros((b, h, t, dc), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, t), float("-inf"), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or k == 0 or n == 0:
        return out, lse
    launch = sparse_launch(h, dc, group_size)
    splits = sparse_splits(b * t, k, launch["BLOCK_K"], q.device)
    # a slice is a whole number of key blocks
    k_split = triton.cdiv(triton.cdiv(k, splits), launch["BLOCK_K"]) * launch["BLOCK_K"]
    splits = triton.cdiv(k, k_split)
    if splits == 1:
        part_out, part_lse = out, lse
        # (b, t, split, h) into (B, H, T, Dc)
        out_strides: tuple[int, ...] = (h * t * dc, dc, 0, t * dc)
        lse_strides: tuple[int, ...] = (h * t, 1, 0, t)
    else:
        part_out = torch.empty((b, t, splits, h, dc), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, t, splits, h), dtype=torch.float32, device=q.device)
        out_strides = part_out.stride()[:4]
        lse_strides = part_lse.stride()
    _sparse_attention_kernel[(b * t, splits)](
        q.contiguous(), kv_packed.contiguous(), kv_scales.contiguous(), idx.contiguous(),
        part_out, part_lse, h, t, n, k, k_split, float(sm_scale), *out_strides, *lse_strides,
        **launch)
    if splits > 1:
        out, lse = _merge_splits(part_out, part_lse)
    return out, lse


def _merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, S, H, Dc) normalised partial outputs and (B, T, S, H) lse -> (B, H, T, Dc) and
    (B, H, T): each slice weighted by its share of the total softmax denominator."""
    lse = torch.logsumexp(part_lse, dim=2)  # (B, T, H); -inf where no slice saw anything
    weights = torch.exp(part_lse - lse.unsqueeze(2)).nan_to_num(0.0)  # -inf - -inf: none
    out = (weights.unsqueeze(-1) * part_out).sum(dim=2)
    return out.permute(0, 2, 1, 3).contiguous(), lse.permute(0, 2, 1).contiguous()
