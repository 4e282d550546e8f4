"""Triton top-k selection for the indexer: a radix select per query row.

The kernel picks the k best entries of a row without sorting it: it maps each score to an
order-preserving 32-bit key, finds the k-th largest key bit by bit (32 counting passes over
the row, which stays in L1/L2), then writes the entries above that key plus the first
entries equal to it, in entry-index order. Torch then orders those k by descending score
with a stable sort (kernels.reference.rank_by_score), so ties go to the lower index exactly
as in the reference. Candidate lists are sorted and de-duplicated in torch first
(kernels.reference.sorted_candidates) for the same reason.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import arg_checks
from kernels.reference import rank_by_score, sorted_candidates
from kernels.triton_quant import require_triton_device


@triton.jit
def _row_keys(scores_ptr, cand_ptr, row, p, P, N, HAS_CAND: tl.constexpr):
    """Entry ids, order-preserving keys (int64 in [0, 2^32)) and pickability of row slots p."""
    in_row = p < P
    ids = tl.load(cand_ptr + row * P + p, mask=in_row, other=N) if HAS_CAND else p.to(tl.int64)
    has_entry = in_row & (ids < N)
    v = tl.load(scores_ptr + row * N + ids, mask=has_entry, other=float("-inf"))
    v = v.to(tl.float32)
    pickable = has_entry & (v > float("-inf"))  # NaN compares false: never picked
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 ties +0.0, as in the float comparison
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed order == float order
    return ids, key.to(tl.int64) + 2147483648, pickable


@triton.jit
def _topk_select_kernel(scores_ptr, cand_ptr, out_ptr, N, P, K,
                        HAS_CAND: tl.constexpr, BLOCK: tl.constexpr):
    # scores (R, N) f32; cand (R, P) i64 ascending ids (N = none) when HAS_CAND, else P = N;
    # out (R, K) i32 prefilled with -1: the selected ids, ascending.
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    # threshold = the largest key t with #(keys >= t) >= K, built from the top bit down
    threshold = tl.zeros([1], tl.int64)
    bit = tl.full([1], 2147483648, tl.int64)
    for _step in range(32):
        trial = threshold + bit
        bit = bit // 2
        count = tl.zeros([1], tl.int32)
        for p0 in range(0, P, BLOCK):
            _ids, key, pickable = _row_keys(scores_ptr, cand_ptr, row, p0 + lane, P, N, HAS_CAND)
            count += tl.sum((pickable & (key >= trial)).to(tl.int32), axis=0)
        threshold = tl.where(count >= K, trial, threshold)
    above = tl.zeros([1], tl.int32)
    for p0 in range(0, P, BLOCK):
        _ids, key, pickable = _row_keys(scores_ptr, cand_ptr, row, p0 + lane, P, N, HAS_CAND)
        above += tl.sum((pickable & (key > threshold)).to(tl.int32), axis=0)
    ties_wanted = K - above  # entries equal to the threshold still to take, lowest id first
    taken = tl.zeros([1], tl.int32)
    ties_seen = tl.zeros([1], tl.int32)
    for p0 in range(0, P, BLOCK):
        ids, key, pickable = _row_keys(scores_ptr, cand_ptr, row, p0 + lane, P, N, HAS_CAND)
        tie = (pickable & (key == threshold)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        take = (pickable & (key > threshold)) | ((tie == 1) & (tie_rank < ties_wanted))
        take_i = take.to(tl.int32)
        slot = taken + tl.cumsum(take_i, axis=0) - take_i
        tl.store(out_ptr + row * K + slot, ids.to(tl.int32), mask=take)
        taken += tl.sum(take_i, axis=0)
        ties_seen += tl.sum(tie, axis=0)


def topk_launch(p: int, has_candidates: bool) -> dict:
    """Constexprs of _topk_select_kernel for rows of p slots."""
    return {"HAS_CAND": has_candidates, "BLOCK": max(16, min(1024, triton.next_power_of_2(p)))}


def indexer_topk(scores: torch.Tensor, k: int,
                 candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k entry indices per query: radix select in Triton, final ordering in torch; see
    kernels.reference.indexer_topk for the contract.

    scores (B, T, N) float; candidates (B, T, P) int32 or None. Returns (B, T, k) int32.
    """
    arg_checks.check_topk(scores, k, candidates)
    tensors = {"scores": scores} if candidates is None else {"scores": scores,
                                                              "candidates": candidates}
    require_triton_device(**tensors)
    b, t, n = scores.shape
    rows = b * t
    scores = scores.float().contiguous()
    if candidates is None:
        cand, p = scores, n  # unused pointer: the kernel enumerates 0..N-1
    else:
        cand = sorted_candidates(candidates, n).contiguous()
        p = cand.shape[-1]
    width = min(k, p)
    picked = torch.full((b, t, width), -1, dtype=torch.int32, device=scores.device)
    if rows and width:
        _topk_select_kernel[(rows,)](scores, cand, picked, n, p, width,
                                     **topk_launch(p, candidates is not None))
    vals = torch.gather(scores, -1, picked.long().clamp_min(0))
    vals = vals.masked_fill(picked < 0, float("-inf"))
    return rank_by_score(vals, picked, k)
