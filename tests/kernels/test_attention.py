"""Window attention over 8-bit KV and sparse compressed attention over 4-bit entries: the
references checked against brute force, and the Triton kernels (interpreted on the CPU)
checked against the references."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import backend, interpret, ops
from kernels import reference as ref

if not torch.cuda.is_available():
    interpret.enable()  # before anything imports triton compiled (see kernels/interpret.py)


@pytest.fixture(scope="module")
def tri():
    with interpret.triton_under_test() as triton_ops:
        yield triton_ops


def _window_case(b, h, hkv, t, s, dh, group, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, dh, generator=g).to(dtype)
    k_codes, k_scales = ref.quantize_int8(torch.randn(b, hkv, s, dh, generator=g), group)
    v_codes, v_scales = ref.quantize_int8(torch.randn(b, hkv, s, dh, generator=g), group)
    # a ring buffer: slot order is not position order, one slot is empty
    k_pos = torch.randperm(s, generator=g) + 3
    k_pos[s // 2] = -1
    q_pos = torch.arange(t) + s - t + 3
    q_pos[0] = -20  # this query sees nothing
    return q, k_codes, k_scales, v_codes, v_scales, q_pos, k_pos


def _brute_window(q, k_codes, k_scales, v_codes, v_scales, q_pos, k_pos, window, group,
                  sm_scale):
    b, h, t, dh = q.shape
    hkv = k_codes.shape[1]
    k = ref.dequantize_int8(k_codes, k_scales, group)
    v = ref.dequantize_int8(v_codes, v_scales, group)
    out = torch.zeros(b, h, t, dh)
    lse = torch.full((b, h, t), -math.inf)
    for bi in range(b):
        for hi in range(h):
            kv_head = hi // (h // hkv)
            for ti in range(t):
                keys = [j for j in range(k_pos.numel()) if k_pos[j] >= 0
                        and 0 <= q_pos[ti] - k_pos[j] < window]
                if not keys:
                    continue
                logits = k[bi, kv_head, keys] @ q[bi, hi, ti].float() * sm_scale
                out[bi, hi, ti] = torch.softmax(logits, 0) @ v[bi, kv_head, keys]
                lse[bi, hi, ti] = torch.logsumexp(logits, 0)
    return out, lse


def _assert_attention_close(got, want, atol=2e-5):
    out, lse = got
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(want[1]))
    assert torch.allclose(out, want[0], atol=atol, rtol=1e-4)
    finite = torch.isfinite(want[1])
    assert torch.allclose(lse[finite], want[1][finite], atol=atol, rtol=1e-4)


WINDOW_CASES = [  # (B, H, Hkv, T, S, Dh, group, window)
    (2, 4, 2, 5, 37, 24, 8, 16),
    (1, 3, 1, 1, 20, 48, 16, 128),
    (1, 2, 2, 7, 5, 16, 16, 3),
    (1, 6, 3, 4, 70, 40, 20, 50),
    (1, 4, 1, 9, 23, 16, 8, 10),  # 36 stacked query rows: several row blocks
]


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_window_reference_matches_brute_force(case):
    b, h, hkv, t, s, dh, group, window = case
    args = _window_case(b, h, hkv, t, s, dh, group)
    sm = dh ** -0.5
    want = _brute_window(*args, window, group, sm)
    _assert_attention_close(ref.window_attention(*args, window, group, sm), want)
    out, lse = ref.window_attention(*args, window, group, sm)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert torch.isinf(lse[:, :, 0]).all()


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_window_triton_matches_reference(tri, case):
    b, h, hkv, t, s, dh, group, window = case
    args = _window_case(b, h, hkv, t, s, dh, group, seed=1)
    sm = dh ** -0.5
    _assert_attention_close(tri.window_attention(*args, window, group, sm),
                            ref.window_attention(*args, window, group, sm))


def test_window_triton_takes_bf16_queries(tri):
    args = _window_case(1, 2, 1, 3, 9, 32, 32, dtype=torch.bfloat16)
    _assert_attention_close(tri.window_attention(*args, 8, 32, 0.2),
                            ref.window_attention(*args, 8, 32, 0.2))


def test_lse_merges_two_key_sets_into_the_full_attention():
    q, kc, ks, vc, vs, q_pos, k_pos = _window_case(1, 2, 2, 4, 30, 16, 8, seed=2)
    full = ref.window_attention(q, kc, ks, vc, vs, q_pos, k_pos, 64, 8, 0.25)
    first = k_pos.clone()
    first[k_pos % 2 == 1] = -1
    second = k_pos.clone()
    second[k_pos % 2 == 0] = -1
    o1, l1 = ref.window_attention(q, kc, ks, vc, vs, q_pos, first, 64, 8, 0.25)
    o2, l2 = ref.window_attention(q, kc, ks, vc, vs, q_pos, second, 64, 8, 0.25)
    lse = torch.logaddexp(l1, l2)
    seen = torch.isfinite(lse)
    merged = (torch.exp(l1 - lse).unsqueeze(-1) * o1 + torch.exp(l2 - lse).unsqueeze(-1) * o2)
    assert torch.allclose(lse[seen], full[1][seen], atol=1e-5)
    assert torch.allclose(merged[seen], full[0][seen], atol=1e-5)


def _sparse_case(b, h, t, n, dc, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, dc, generator=g)
    kv_packed, kv_scales = ref.quantize_int4(torch.randn(b, n, dc, generator=g), group)
    idx = torch.randint(-1, n, (b, t, k), generator=g, dtype=torch.int32)
    if t > 1:
        idx[0, 0] = -1  # a query with no entry
    else:
        idx[0, 0, : k // 2] = -1  # the first slices of the split work see nothing
    return q, kv_packed, kv_scales, idx


SPARSE_CASES = [  # (B, H, T, N, Dc, K, group)
    (2, 4, 5, 13, 48, 6, 16),
    (1, 3, 3, 40, 32, 70, 8),
    (1, 1, 2, 9, 24, 5, 24),
    (1, 20, 2, 9, 32, 40, 8),  # more heads than one 16-row tile
    (1, 2, 1, 60, 16, 300, 8),  # one query, many entries: the work is split and merged
]


@pytest.mark.parametrize("case", SPARSE_CASES)
def test_sparse_reference_matches_brute_force(case):
    b, h, t, n, dc, k, group = case
    q, kv_packed, kv_scales, idx = _sparse_case(*case)
    kv = ref.dequantize_int4(kv_packed, kv_scales, group)
    out, lse = ref.sparse_compressed_attention(q, kv_packed, kv_scales, idx, group, 0.3)
    for bi in range(b):
        for ti in range(t):
            picked = [int(i) for i in idx[bi, ti] if i >= 0]
            for hi in range(h):
                if not picked:
                    assert out[bi, hi, ti].abs().sum() == 0 and lse[bi, hi, ti] == -math.inf
                    continue
                logits = kv[bi, picked] @ q[bi, hi, ti] * 0.3
                want = torch.softmax(logits, 0) @ kv[bi, picked]
                assert torch.allclose(out[bi, hi, ti], want, atol=1e-5)
                assert torch.allclose(lse[bi, hi, ti], torch.logsumexp(logits, 0), atol=1e-5)


@pytest.mark.parametrize("case", SPARSE_CASES)
def test_sparse_triton_matches_reference(tri, case):
    *_, group = case
    args = _sparse_case(*case, seed=1)
    _assert_attention_close(tri.sparse_compressed_attention(*args, group, 0.3),
                            ref.sparse_compressed_attention(*args, group, 0.3))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_sparse_rejects_out_of_range_indices(tri, impl):
    q, kv_packed, kv_scales, idx = _sparse_case(1, 2, 2, 5, 16, 3, 8)
    idx[0, 1, 2] = 5
    module = ref if impl == "reference" else tri
    with pytest.raises(ValueError, match=r"idx values must lie in \[-1, 4\]"):
        module.sparse_compressed_attention(q, kv_packed, kv_scales, idx, 8, 0.3)


@pytest.mark.parametrize("call,message", [
    (lambda m, a: m.window_attention(a[0][:, :3], *a[1:], 8, 8, 0.1),
     "multiple of KV heads"),
    (lambda m, a: m.window_attention(a[0], a[1].float(), *a[2:], 8, 8, 0.1), "k_codes"),
    (lambda m, a: m.window_attention(*a[:5], a[5].int(), a[6], 8, 8, 0.1), "q_pos"),
    (lambda m, a: m.window_attention(*a[:6], a[6][:-1], 8, 8, 0.1), "k_pos must have shape"),
    (lambda m, a: m.window_attention(*a, 0, 8, 0.1), "window"),
    (lambda m, a: m.window_attention(*a, 8, 5, 0.1), "multiple of group_size"),
])
def test_window_bad_input_is_rejected_by_both_backends(tri, call, message):
    args = _window_case(1, 4, 2, 3, 6, 16, 8)
    for module in (ref, tri):
        with pytest.raises(ValueError, match=message):
            call(module, args)


def test_ops_dispatch_runs_triton_and_keeps_gradients_on_the_reference(tri):
    args = tuple(tri.to_device(a) for a in _window_case(1, 2, 1, 3, 9, 16, 8, seed=3))
    assert backend.triton_usable(*args)
    with backend.use("triton"):
        out, _ = ops.window_attention(*args, 8, 8, 0.25)
        q = args[0].clone().requires_grad_(True)
        grad_out, _ = ops.window_attention(q, *args[1:], 8, 8, 0.25)
        grad_out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert torch.allclose(out, grad_out.detach(), atol=2e-5)


def test_reference_gradients_stay_finite_when_a_query_sees_nothing():
    q = torch.randn(1, 2, 3, 16, requires_grad=True)
    kv_packed, kv_scales = ref.quantize_int4(torch.randn(1, 5, 16), 8)
    idx = torch.tensor([[[0, 1], [-1, -1], [2, -1]]], dtype=torch.int32)
    out, lse = ref.sparse_compressed_attention(q, kv_packed, kv_scales, idx, 8, 0.25)
    (out.sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()).backward()
    assert torch.isfinite(q.grad).all()
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))
    assert q.grad[:, :, 0].abs().sum() > 0
