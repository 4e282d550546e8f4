"""Public kernel API: each call runs the selected backend (see kernels/backend.py).

The Triton path runs on CUDA tensors and is inference-only: with the Triton backend selected,
a call still runs the PyTorch reference for CPU tensors (unless kernels.interpret routes them
through Triton's interpreter) and for the attention/indexer maths when autograd needs
gradients (the model trains through the reference). Signatures and layouts are documented on
the references in kernels/reference.py.
"""

from __future__ import annotations

import torch

from kernels import backend, reference


def _impl(name: str, tensors: tuple[torch.Tensor, ...], differentiable: bool = False):
    if backend.current() == "triton" and backend.triton_usable(*tensors):
        needs_grad = differentiable and torch.is_grad_enabled() and any(
            t.requires_grad for t in tensors)
        if not needs_grad:
            return getattr(backend.triton_module(), name)
    return getattr(reference, name)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(..., D) int8 in [-8, 7] -> (..., D/2) uint8; code 2i low nibble, 2i+1 high nibble."""
    return _impl("pack_int4", (q,))(q)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(..., D/2) uint8 -> (..., D) int8 in [-8, 7]."""
    return _impl("unpack_int4", (packed,))(packed)


def quantize_int4(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float (..., D) -> (packed uint8 (..., D/2), scales fp16 (..., D/group_size))."""
    return _impl("quantize_int4", (x,))(x, group_size)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """packed uint8 (..., D/2), scales fp16 (..., D/group_size) -> float32 (..., D)."""
    return _impl("dequantize_int4", (packed, scales))(packed, scales, group_size)


def quantize_int8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float (..., D) -> (codes int8 (..., D), scales fp16 (..., D/group_size))."""
    return _impl("quantize_int8", (x,))(x, group_size)


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """codes int8 (..., D), scales fp16 (..., D/group_size) -> float32 (..., D)."""
    return _impl("dequantize_int8", (codes, scales))(codes, scales, group_size)


def window_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor,
                     v_codes: torch.Tensor, v_scales: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, window: int, group_size: int,
                     sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, Dh) float; k/v codes (B, Hkv, S, Dh) int8; k/v scales (B, Hkv, S,
    Dh/group_size) fp16; q_pos (T,) int64; k_pos (S,) int64 (negative = empty slot).
    Returns out (B, H, T, Dh) float32, lse (B, H, T) float32 (-inf where nothing visible)."""
    fn = _impl("window_attention", (q, k_codes, k_scales, v_codes, v_scales, q_pos, k_pos),
               differentiable=True)
    return fn(q, k_codes, k_scales, v_codes, v_scales, q_pos, k_pos, window, group_size,
              sm_scale)


def sparse_compressed_attention(q: torch.Tensor, kv_packed: torch.Tensor,
                                kv_scales: torch.Tensor, idx: torch.Tensor, group_size: int,
                                sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, Dc) float; kv_packed (B, N, Dc/2) uint8; kv_scales (B, N, Dc/group_size)
    fp16; idx (B, T, K) int32 (-1 unused). Returns out (B, H, T, Dc) float32, lse (B, H, T)."""
    fn = _impl("sparse_compressed_attention", (q, kv_packed, kv_scales, idx),
               differentiable=True)
    return fn(q, kv_packed, kv_scales, idx, group_size, sm_scale)


def indexer_scores(qi: torch.Tensor, ki_packed: torch.Tensor, ki_scales: torch.Tensor,
                   w: torch.Tensor, n_visible: torch.Tensor, group_size: int) -> torch.Tensor:
    """qi (B, T, Hi, Di) float; ki_packed (B, N, Di/2) uint8; ki_scales (B, N, Di/group_size)
    fp16; w (B, T, Hi) float; n_visible (T,) or (B, T) int64 (entries visible per query, one
    vector for the batch or one per batch row). Returns scores (B, T, N) float32."""
    fn = _impl("indexer_scores", (qi, ki_packed, ki_scales, w, n_visible), differentiable=True)
    return fn(qi, ki_packed, ki_scales, w, n_visible, group_size)


def indexer_topk(scores: torch.Tensor, k: int,
                 candidates: torch.Tensor | None = None) -> torch.Tensor:
    """scores (B, T, N) float; candidates (B, T, P) int32 or None. Returns (B, T, k) int32,
    descending score, ties to the lower index, -1 past the pickable entries."""
    tensors = (scores,) if candidates is None else (scores, candidates)
    return _impl("indexer_topk", tensors)(scores, k, candidates)
