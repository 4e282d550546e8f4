"""Boundary checks shared by the references and the Triton wrappers, so both reject the same
bad input with the same ValueError message."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def require_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        wanted = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must be {wanted}, got {t.dtype}")


def require_float(name: str, t: torch.Tensor) -> None:
    require_dtype(name, t, *FLOAT_DTYPES)


def require_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def require_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def require_same_device(**tensors: torch.Tensor | None) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"all tensors must be on one device: {listing}")


def require_groups(dim: int, group_size: int, what: str, even: bool = False) -> int:
    """Number of scale groups along a last dimension of `dim` elements."""
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if dim % group_size:
        raise ValueError(f"{what} dimension {dim} is not a multiple of group_size {group_size}")
    if even and group_size % 2:
        raise ValueError(f"int4 group_size must be even (two codes per byte), got {group_size}")
    return dim // group_size


def require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_quantize(x: torch.Tensor, group_size: int, int4: bool) -> int:
    """Validates quantize input (..., D); returns the number of groups."""
    require_float("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (..., D)")
    return require_groups(x.shape[-1], group_size, "x last", even=int4)


def check_dequantize(codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                     int4: bool) -> int:
    """Validates codes (..., D or D/2) and scales (..., D/group_size) fp16; returns D."""
    require_dtype("packed" if int4 else "codes", codes, torch.uint8 if int4 else torch.int8)
    require_dtype("scales", scales, torch.float16)
    require_same_device(codes=codes, scales=scales)
    if codes.dim() < 1:
        raise ValueError("codes must have at least one dimension")
    dim = codes.shape[-1] * (2 if int4 else 1)
    groups = require_groups(dim, group_size, "unpacked last", even=int4)
    require_shape("scales", scales, (*codes.shape[:-1], groups))
    return dim


def check_window_attention(q, k_codes, k_scales, v_codes, v_scales, q_pos, k_pos, window,
                           group_size, sm_scale) -> tuple[int, int, int, int, int, int]:
    """Returns (B, H, T, Dh, Hkv, S)."""
    require_float("q", q)
    require_ndim("q", q, 4, "(B, H, T, Dh)")
    require_dtype("k_codes", k_codes, torch.int8)
    require_dtype("v_codes", v_codes, torch.int8)
    require_ndim("k_codes", k_codes, 4, "(B, Hkv, S, Dh)")
    require_dtype("k_scales", k_scales, torch.float16)
    require_dtype("v_scales", v_scales, torch.float16)
    require_dtype("q_pos", q_pos, torch.int64)
    require_dtype("k_pos", k_pos, torch.int64)
    require_same_device(q=q, k_codes=k_codes, k_scales=k_scales, v_codes=v_codes,
                        v_scales=v_scales, q_pos=q_pos, k_pos=k_pos)
    b, h, t, dh = q.shape
    hkv, s = k_codes.shape[1], k_codes.shape[2]
    require_shape("k_codes", k_codes, (b, hkv, s, dh))
    require_shape("v_codes", v_codes, (b, hkv, s, dh))
    if hkv == 0 or h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of KV heads {hkv}")
    groups = require_groups(dh, group_size, "head")
    require_shape("k_scales", k_scales, (b, hkv, s, groups))
    require_shape("v_scales", v_scales, (b, hkv, s, groups))
    require_shape("q_pos", q_pos, (t,))
    require_shape("k_pos", k_pos, (s,))
    require_positive("window", window)
    if not isinstance(sm_scale, float | int):
        raise ValueError(f"sm_scale must be a number, got {type(sm_scale).__name__}")
    return b, h, t, dh, hkv, s


def check_sparse_attention(q, kv_packed, kv_scales, idx, group_size,
                           sm_scale) -> tuple[int, int, int, int, int, int]:
    """Returns (B, H, T, Dc, N, K)."""
    require_float("q", q)
    require_ndim("q", q, 4, "(B, H, T, Dc)")
    require_dtype("kv_packed", kv_packed, torch.uint8)
    require_ndim("kv_packed", kv_packed, 3, "(B, N, Dc/2)")
    require_dtype("kv_scales", kv_scales, torch.float16)
    require_dtype("idx", idx, torch.int32)
    require_ndim("idx", idx, 3, "(B, T, K)")
    require_same_device(q=q, kv_packed=kv_packed, kv_scales=kv_scales, idx=idx)
    b, h, t, dc = q.shape
    n = kv_packed.shape[1]
    require_shape("kv_packed", kv_packed, (b, n, dc // 2))
    if dc % 2:
        raise ValueError(f"latent dimension Dc={dc} must be even for int4 packing")
    groups = require_groups(dc, group_size, "latent", even=True)
    require_shape("kv_scales", kv_scales, (b, n, groups))
    k = idx.shape[2]
    require_shape("idx", idx, (b, t, k))
    if not isinstance(sm_scale, float | int):
        raise ValueError(f"sm_scale must be a number, got {type(sm_scale).__name__}")
    if idx.numel() and (int(idx.max()) >= n or int(idx.min()) < -1):
        raise ValueError(f"idx values must lie in [-1, {n - 1}] (N={n} entries)")
    return b, h, t, dc, n, k


def check_indexer_scores(qi, ki_packed, ki_scales, w, n_visible,
                         group_size) -> tuple[int, int, int, int, int]:
    """Returns (B, T, Hi, Di, N)."""
    require_float("qi", qi)
    require_ndim("qi", qi, 4, "(B, T, Hi, Di)")
    require_dtype("ki_packed", ki_packed, torch.uint8)
    require_ndim("ki_packed", ki_packed, 3, "(B, N, Di/2)")
    require_dtype("ki_scales", ki_scales, torch.float16)
    require_float("w", w)
    require_dtype("n_visible", n_visible, torch.int64)
    require_same_device(qi=qi, ki_packed=ki_packed, ki_scales=ki_scales, w=w,
                        n_visible=n_visible)
    b, t, hi, di = qi.shape
    n = ki_packed.shape[1]
    if hi == 0:
        raise ValueError("qi must have at least one indexer head (B, T, Hi >= 1, Di)")
    if di % 2:
        raise ValueError(f"index dimension Di={di} must be even for int4 packing")
    require_shape("ki_packed", ki_packed, (b, n, di // 2))
    groups = require_groups(di, group_size, "index key", even=True)
    require_shape("ki_scales", ki_scales, (b, n, groups))
    require_shape("w", w, (b, t, hi))
    if tuple(n_visible.shape) != (b, t):
        require_shape("n_visible", n_visible, (t,))  # one vector shared by the batch
    return b, t, hi, di, n


def check_topk(scores, k, candidates) -> None:
    require_float("scores", scores)
    require_ndim("scores", scores, 3, "(B, T, N)")
    require_positive("k", k)
    if candidates is not None:
        require_dtype("candidates", candidates, torch.int32)
        require_ndim("candidates", candidates, 3, "(B, T, P)")
        require_same_device(scores=scores, candidates=candidates)
        b, t, n = scores.shape
        require_shape("candidates", candidates, (b, t, candidates.shape[2]))
        if candidates.numel() and (int(candidates.max()) >= n or int(candidates.min()) < -1):
            raise ValueError(f"candidates must lie in [-1, {n - 1}] (N={n} entries)")
