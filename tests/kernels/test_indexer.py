"""Indexer scoring over int4 keys and top-k selection: reference semantics against brute
force, the Triton scoring kernel (interpreted on the CPU) against the reference, and the
backend switch."""

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


def _index_case(b, t, hi, di, n, group, seed=0, per_row=False):
    """per_row: n_visible (B, T), one vector per batch row (sessions of different
    lengths in one call); otherwise (T,) shared by the batch."""
    g = torch.Generator().manual_seed(seed)
    ki_packed, ki_scales = ref.quantize_int4(torch.randn(b, n, di, generator=g), group)
    qi = torch.randn(b, t, hi, di, generator=g)
    w = torch.rand(b, t, hi, generator=g)
    n_visible = torch.randint(0, n + 1, (b, t) if per_row else (t,), generator=g)
    n_visible[..., 0] = 0
    n_visible[..., -1] = n
    return qi, ki_packed, ki_scales, w, n_visible


INDEX_CASES = [  # (B, T, Hi, Di, N, group)
    (2, 5, 3, 48, 13, 16),
    (1, 1, 2, 32, 100, 8),
    (1, 20, 1, 64, 70, 64),
]


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("case", INDEX_CASES[:2])
def test_scores_reference_matches_brute_force(case, per_row):
    b, t, hi, di, n, group = case
    qi, ki_packed, ki_scales, w, n_visible = _index_case(*case, per_row=per_row)
    ki = ref.dequantize_int4(ki_packed, ki_scales, group)
    scores = ref.indexer_scores(qi, ki_packed, ki_scales, w, n_visible, group)
    assert scores.shape == (b, t, n) and scores.dtype == torch.float32
    visible = n_visible.expand(b, t)
    for bi in range(b):
        for ti in range(t):
            for ni in range(n):
                if ni >= visible[bi, ti]:
                    assert scores[bi, ti, ni] == -math.inf
                    continue
                want = sum(w[bi, ti, h] * torch.relu(qi[bi, ti, h] @ ki[bi, ni])
                           for h in range(hi))
                assert torch.allclose(scores[bi, ti, ni], want, atol=1e-5)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("case", INDEX_CASES)
def test_scores_triton_matches_reference(tri, case, per_row):
    *_, group = case
    args = _index_case(*case, seed=1, per_row=per_row)
    want = ref.indexer_scores(*args, group)
    got = tri.indexer_scores(*args, group)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=1e-4, rtol=1e-5)


def test_scores_triton_causal_corner_is_minus_inf(tri):
    # entries past every query's n_visible: whole tiles the kernel skips
    qi, ki_packed, ki_scales, w, _ = _index_case(1, 8, 2, 32, 100, 16, seed=4)
    n_visible = torch.arange(8) + 1
    want = ref.indexer_scores(qi, ki_packed, ki_scales, w, n_visible, 16)
    got = tri.indexer_scores(qi, ki_packed, ki_scales, w, n_visible, 16)
    assert torch.isinf(got[..., 8:]).all()
    assert torch.allclose(got[..., :8].nan_to_num(neginf=0.0), want[..., :8].nan_to_num(
        neginf=0.0), atol=1e-4)


def test_scores_reject_bad_input(tri):
    qi, ki_packed, ki_scales, w, n_visible = _index_case(1, 2, 2, 16, 5, 8)
    for module in (ref, tri):
        with pytest.raises(ValueError, match="w must have shape"):
            module.indexer_scores(qi, ki_packed, ki_scales, w[:, :, :1], n_visible, 8)
        with pytest.raises(ValueError, match="n_visible must be torch.int64"):
            module.indexer_scores(qi, ki_packed, ki_scales, w, n_visible.int(), 8)
        with pytest.raises(ValueError, match="n_visible must have shape"):
            module.indexer_scores(qi, ki_packed, ki_scales, w, n_visible.expand(2, 2), 8)


def _topk(scores, k, candidates=None):
    rows = torch.tensor(scores, dtype=torch.float32).view(1, 1, -1)
    cand = None if candidates is None else torch.tensor(candidates, dtype=torch.int32)
    return ref.indexer_topk(rows, k, None if cand is None else cand.view(1, 1, -1))[0, 0]


def test_topk_sorts_descending_and_breaks_ties_by_lower_index():
    got = _topk([1.0, 3.0, 2.0, 3.0, 1.0, 3.0], 5)
    assert got.tolist() == [1, 3, 5, 2, 0]
    assert got.dtype == torch.int32


def test_topk_pads_with_minus_one_past_the_pickable_entries():
    inf = math.inf
    assert _topk([-inf, 2.0, float("nan"), -inf, 1.0], 4).tolist() == [1, 4, -1, -1]
    assert _topk([0.5, 0.25], 5).tolist() == [0, 1, -1, -1, -1]


def test_topk_restricted_to_candidates():
    scores = [9.0, 1.0, 5.0, 5.0, 7.0, 5.0]
    # candidate order must not matter; ties still go to the lower entry index
    assert _topk(scores, 3, [5, 2, -1, 3]).tolist() == [2, 3, 5]
    assert _topk(scores, 4, [4, -1, 4, 1]).tolist() == [4, 1, -1, -1]  # repeats count once
    assert _topk(scores, 2, [-1, -1]).tolist() == [-1, -1]


def test_topk_matches_torch_topk_on_distinct_scores():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 3, 50, generator=g)
    want = torch.topk(scores, 7, dim=-1).indices.to(torch.int32)
    assert torch.equal(ref.indexer_topk(scores, 7), want)


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (40, 40), (33, 64), (257, 5)])
def test_topk_matches_brute_force_ranking_with_ties(n, k):
    # few distinct values, -inf and NaN: ties at the k-th place are the hard case
    g = torch.Generator().manual_seed(n * 100 + k)
    values = torch.tensor([-math.inf, math.nan, 0.0, 0.5, 1.0, 2.0])
    scores = values[torch.randint(0, len(values), (2, 3, n), generator=g)]
    got = ref.indexer_topk(scores, k)
    for row, picked in zip(scores.view(-1, n).tolist(), got.view(-1, k).tolist(),
                           strict=True):
        pickable = [i for i, v in enumerate(row) if v > -math.inf]  # NaN compares false
        ranked = sorted(pickable, key=lambda i: (-row[i], i))[:k]
        assert picked == ranked + [-1] * (k - len(ranked))


def test_topk_rejects_bad_candidates():
    with pytest.raises(ValueError, match=r"candidates must lie in \[-1, 4\]"):
        ref.indexer_topk(torch.zeros(1, 1, 5), 2, torch.tensor([[[0, 5]]], dtype=torch.int32))
    with pytest.raises(ValueError, match="k must be a positive int"):
        ref.indexer_topk(torch.zeros(1, 1, 5), 0)


def _awkward_scores(b, t, n, seed):
    """Coarse scores (many ties) plus -inf, NaN, +inf and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.round(torch.randn(b, t, n, generator=g) * 4) / 4
    scores[0, 0, :3] = -math.inf
    scores[0, 0, 3] = math.nan
    scores[0, -1, 5] = math.inf
    scores[-1, -1, ::2] = 0.0
    scores[-1, -1, 1::4] = -0.0
    return scores


@pytest.mark.parametrize("b,t,n,k,pool", [(1, 3, 30, 5, 0), (1, 2, 40, 50, 0),
                                          (2, 1, 25, 6, 11), (1, 2, 20, 30, 24)])
def test_topk_triton_matches_reference(tri, b, t, n, k, pool):
    scores = _awkward_scores(b, t, n, seed=n)
    candidates = None
    if pool:
        g = torch.Generator().manual_seed(k)
        candidates = torch.randint(-1, n, (b, t, pool), generator=g, dtype=torch.int32)
    assert torch.equal(tri.indexer_topk(scores, k, candidates),
                       ref.indexer_topk(scores, k, candidates))


def test_ops_scoring_and_selection_agree_across_backends(tri):
    qi, ki_packed, ki_scales, w, n_visible = (
        tri.to_device(a) for a in _index_case(1, 2, 2, 32, 13, 16, seed=3))
    candidates = tri.to_device(torch.randint(-1, 13, (1, 2, 9), dtype=torch.int32))
    assert backend.triton_usable(qi, candidates)
    want = ref.indexer_scores(qi, ki_packed, ki_scales, w, n_visible, 16)
    with backend.use("triton"):
        got = ops.indexer_scores(qi, ki_packed, ki_scales, w, n_visible, 16)
        picks = ops.indexer_topk(want, 4), ops.indexer_topk(want, 6, candidates)
    assert torch.allclose(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0), atol=1e-4)
    assert torch.equal(picks[0], ref.indexer_topk(want, 4))
    assert torch.equal(picks[1], ref.indexer_topk(want, 6, candidates))
