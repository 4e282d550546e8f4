"""PyTorch references for every kernel: the CPU path, the training path (plain differentiable
torch where the maths allows) and the oracle the Triton kernels are tested against.

Every function has the same signature as its Triton twin in kernels/triton_ops.py.
"""

from __future__ import annotations

import torch

from kernels import arg_checks

INT4_MIN, INT4_MAX = -8, 7
INT8_MAX = 127


# ---------------------------------------------------------------- int4 packing


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(..., D) int8 in [-8, 7] -> (..., D/2) uint8; code 2i in the low nibble, 2i+1 high."""
    arg_checks.require_dtype("q", q, torch.int8)
    if q.dim() < 1 or q.shape[-1] % 2:
        raise ValueError(f"q last dimension must be even, got shape {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < INT4_MIN or int(q.max()) > INT4_MAX):
        raise ValueError("q values must lie in [-8, 7] to fit a 4-bit nibble")
    nib = q.to(torch.int16) & 0xF  # two's complement nibble
    lo, hi = nib[..., 0::2], nib[..., 1::2]
    return (lo | (hi << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(..., D/2) uint8 -> (..., D) int8 in [-8, 7]; exact inverse of pack_int4."""
    arg_checks.require_dtype("packed", packed, torch.uint8)
    if packed.dim() < 1:
        raise ValueError("packed must have at least one dimension (..., D/2)")
    p = packed.to(torch.int16)
    lo, hi = p & 0xF, (p >> 4) & 0xF
    # sign-extend a nibble: values 8..15 stand for -8..-1
    lo, hi = lo - ((lo & 8) << 1), hi - ((hi & 8) << 1)
    pairs = torch.stack((lo, hi), dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).to(torch.int8)


# ---------------------------------------------------------------- group quantization


def _group_codes(x: torch.Tensor, group_size: int, qmax: int,
                 qmin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group codes: (..., D) -> codes int8 (..., D), scales fp16 (..., G).

    The scale is rounded to fp16 before the codes are computed, so a reader that dequantizes
    with the stored fp16 scale sees exactly the values the codes were chosen for. A group
    that cannot be represented (a NaN or inf in it, or absmax/qmax beyond fp16's range) gets
    a NaN scale and zero codes: it dequantizes to NaN, poisoned rather than silently wrong.
    """
    groups = x.shape[-1] // group_size
    g = x.float().reshape(*x.shape[:-1], groups, group_size)
    absmax = g.abs().amax(dim=-1)  # NaN if the group holds one
    # divide by a tensor, not a Python scalar: CUDA torch turns x / scalar into x * (1 /
    # scalar), which can differ by an ulp from the correctly rounded division Triton does
    scales = (absmax / torch.full_like(absmax, qmax)).to(torch.float16)
    scales = torch.where(scales < float("inf"), scales, torch.full_like(scales, float("nan")))
    s = scales.float().unsqueeze(-1)
    usable = s > 0  # false for a zero group and for NaN
    codes = torch.round(g / torch.where(usable, s, torch.ones_like(s)))
    codes = torch.where(usable, codes, torch.zeros_like(codes)).clamp(qmin, qmax)
    return codes.to(torch.int8).reshape(x.shape), scales


def _dequant(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes (..., D) integer, scales fp16 (..., D/group_size) -> float32 (..., D)."""
    g = codes.float().reshape(*codes.shape[:-1], codes.shape[-1] // group_size, group_size)
    return (g * scales.float().unsqueeze(-1)).reshape(codes.shape)


def quantize_int4(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float (..., D) -> (packed uint8 (..., D/2), scales fp16 (..., D/group_size))."""
    arg_checks.check_quantize(x, group_size, int4=True)
    codes, scales = _group_codes(x, group_size, INT4_MAX, INT4_MIN)
    return pack_int4(codes), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """packed uint8 (..., D/2), scales fp16 (..., D/group_size) -> float32 (..., D)."""
    arg_checks.check_dequantize(packed, scales, group_size, int4=True)
    return _dequant(unpack_int4(packed), scales, group_size)


def quantize_int8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float (..., D) -> (codes int8 (..., D) in [-127, 127], scales fp16 (..., D/group_size))."""
    arg_checks.check_quantize(x, group_size, int4=False)
    return _group_codes(x, group_size, INT8_MAX, -INT8_MAX)


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """codes int8 (..., D), scales fp16 (..., D/group_size) -> float32 (..., D)."""
    arg_checks.check_dequantize(codes, scales, group_size, int4=False)
    return _dequant(codes, scales, group_size)


# ---------------------------------------------------------------- attention


def _masked_softmax(scores: torch.Tensor, visible: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim with a visibility mask; rows with nothing visible give
    all-zero probabilities and lse = -inf (instead of NaN), so callers can merge paths."""
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(scores - safe.unsqueeze(-1)), lse


def window_attention(q, k_codes, k_scales, v_codes, v_scales, q_pos, k_pos, window: int,
                     group_size: int, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window attention over 8-bit KV.

    q (B, H, T, Dh) float; k_codes/v_codes (B, Hkv, S, Dh) int8; k_scales/v_scales
    (B, Hkv, S, Dh/group_size) fp16; q_pos (T,) int64; k_pos (S,) int64 (negative = empty
    slot). Key j is visible to query i iff 0 <= q_pos[i] - k_pos[j] < window.
    Returns out (B, H, T, Dh) float32 and lse (B, H, T) float32.
    """
    b, h, t, dh, hkv, s = arg_checks.check_window_attention(
        q, k_codes, k_scales, v_codes, v_scales, q_pos, k_pos, window, group_size, sm_scale)
    rep = h // hkv
    k = _dequant(k_codes, k_scales, group_size).repeat_interleave(rep, dim=1)
    v = _dequant(v_codes, v_scales, group_size).repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * sm_scale  # (B, H, T, S)
    delta = q_pos.view(t, 1) - k_pos.view(1, s)
    visible = (delta >= 0) & (delta < window) & (k_pos.view(1, s) >= 0)
    p, lse = _masked_softmax(scores, visible)
    return torch.matmul(p, v), lse


def sparse_compressed_attention(q, kv_packed, kv_scales, idx, group_size: int,
                                sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA-style absorbed attention over selected int4 compressed entries.

    q (B, H, T, Dc) float; kv_packed (B, N, Dc/2) uint8; kv_scales (B, N, Dc/group_size)
    fp16; idx (B, T, K) int32 indices into N, -1 = unused. Each entry's latent is both key
    and value. Returns out (B, H, T, Dc) float32 and lse (B, H, T) float32.
    """
    b, h, t, dc, n, k = arg_checks.check_sparse_attention(
        q, kv_packed, kv_scales, idx, group_size, sm_scale)
    kv = _dequant(unpack_int4(kv_packed), kv_scales, group_size)  # (B, N, Dc)
    used = idx >= 0
    flat = idx.clamp_min(0).long().reshape(b, t * k, 1).expand(b, t * k, dc)
    picked = torch.gather(kv, 1, flat).reshape(b, t, k, dc)  # (B, T, K, Dc)
    scores = torch.einsum("bhtd,btkd->bhtk", q.float(), picked) * sm_scale
    p, lse = _masked_softmax(scores, used.unsqueeze(1))
    return torch.einsum("bhtk,btkd->bhtd", p, picked), lse


# ---------------------------------------------------------------- indexer


def indexer_scores(qi, ki_packed, ki_scales, w, n_visible, group_size: int) -> torch.Tensor:
    """score[b,t,n] = sum_h w[b,t,h] * relu(qi[b,t,h] . dequant(ki)[b,n]); -inf for n >=
    n_visible[b,t] (n_visible[t] when it is one vector for the whole batch).

    qi (B, T, Hi, Di) float; ki_packed (B, N, Di/2) uint8; ki_scales (B, N, Di/group_size)
    fp16; w (B, T, Hi) float; n_visible (T,) or (B, T) int64. Returns (B, T, N) float32.
    """
    b, t, hi, di, n = arg_checks.check_indexer_scores(qi, ki_packed, ki_scales, w, n_visible,
                                                  group_size)
    ki = _dequant(unpack_int4(ki_packed), ki_scales, group_size)  # (B, N, Di)
    dots = torch.relu(torch.einsum("bthd,bnd->bthn", qi.float(), ki))
    scores = torch.einsum("bthn,bth->btn", dots, w.float())
    visible = torch.arange(n, device=qi.device).view(1, 1, n) < n_visible.view(-1, t, 1)
    return scores.masked_fill(~visible, float("-inf"))


def indexer_topk(scores: torch.Tensor, k: int,
                 candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k entry indices per query, sorted by descending score, ties to the lower index.

    scores (B, T, N) float; candidates (B, T, P) int32 or None (-1 = no candidate; repeated
    candidates count once). Entries scoring -inf or NaN are never picked; slots beyond the
    number of pickable entries hold -1. Returns (B, T, k) int32. Deterministic: entries in
    ascending index order, then a stable sort by descending score.
    """
    arg_checks.check_topk(scores, k, candidates)
    n = scores.shape[-1]
    s = scores.float()
    if candidates is None:
        return top_by_threshold(s, k)
    ids = sorted_candidates(candidates, n)
    vals = torch.gather(s, -1, ids.clamp_max(n - 1)) if n else s.new_zeros(ids.shape)
    vals = vals.masked_fill(ids >= n, float("-inf"))
    return rank_by_score(vals, ids, k)


def top_by_threshold(vals: torch.Tensor, k: int) -> torch.Tensor:
    """indexer_topk over every entry: vals (B, T, N) float -> (B, T, k) int32.

    A full sort of N entries per query dominated replay on CPU. Instead torch.topk finds
    the k-th best value (well defined whatever its tie-breaking), entries above it are in,
    entries equal to it fill the remaining places lowest index first, and only the k
    winners are sorted."""
    b, t, n = vals.shape
    vals = torch.where(torch.isnan(vals), torch.full_like(vals, float("-inf")), vals)
    kk = min(k, n)
    if kk == 0:
        return torch.full((b, t, k), -1, dtype=torch.int32, device=vals.device)
    kth = torch.topk(vals, kk, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = vals > kth
    tied = (vals == kth) & (kth > float("-inf"))
    room = kk - above.sum(dim=-1, keepdim=True)
    keep = above | (tied & (tied.cumsum(dim=-1) <= room))
    # the winners' ids in ascending order go to slots 0.., every loser to slot kk
    slot = torch.where(keep, keep.cumsum(dim=-1) - 1, kk)
    ids = torch.full((b, t, kk + 1), -1, dtype=torch.long, device=vals.device)
    ids.scatter_(-1, slot, torch.arange(n, device=vals.device).expand(b, t, n))
    ids = ids[..., :kk]
    picked = torch.gather(vals, -1, ids.clamp_min(0)).masked_fill(ids < 0, float("-inf"))
    return rank_by_score(picked, ids, k)


def sorted_candidates(candidates: torch.Tensor, n: int) -> torch.Tensor:
    """candidates (B, T, P) int32 -> (B, T, P) int64 entry ids in ascending order, with -1
    and repeats replaced by n (no entry), so a stable score sort breaks ties by index."""
    ids = torch.where(candidates >= 0, candidates.long(),
                      torch.full_like(candidates, n, dtype=torch.long))
    ids, _ = torch.sort(ids, dim=-1, stable=True)
    repeated = torch.zeros_like(ids, dtype=torch.bool)
    repeated[..., 1:] = ids[..., 1:] == ids[..., :-1]
    return ids.masked_fill(repeated, n)


def rank_by_score(vals: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """vals (B, T, P) float, ids (B, T, P) int, ascending among the pickable entries ->
    (B, T, k) int32: the k best ids by descending value, ties to the lower id, -1 for -inf,
    NaN and past the end."""
    b, t, _ = vals.shape
    vals = torch.where(torch.isnan(vals), torch.full_like(vals, float("-inf")), vals)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices[..., :k]
    top_vals = torch.gather(vals, -1, order)
    top_ids = torch.gather(ids, -1, order).long()
    top_ids = torch.where(top_vals > float("-inf"), top_ids, torch.full_like(top_ids, -1))
    if top_ids.shape[-1] < k:
        pad = top_ids.new_full((b, t, k - top_ids.shape[-1]), -1)
        top_ids = torch.cat((top_ids, pad), dim=-1)
    return top_ids.to(torch.int32)
