"""The model's inference path through the Triton kernels (compiled on CUDA, interpreted on
the CPU) gives the logits and state the PyTorch references give: what the replay worker
runs on a GPU is the function the tests check on the CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import backend, interpret
from model.config import TINY
from model.infer import decode_step, prefill, replay
from model.net import KVTierLM

if not torch.cuda.is_available():
    interpret.enable()  # before anything imports triton compiled (see kernels/interpret.py)


def run(model: KVTierLM, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Prefill in chunks, decode, evict and replay, decode again; logits and final state."""
    st, logits = prefill(model, ids[:13], logits="all", chunk=5)
    rows = [logits.cpu()] + [decode_step(model, st, int(t)).cpu()[None] for t in ids[13:17]]
    st = replay(model, st.without_window(), r=TINY.window)
    rows += [decode_step(model, st, int(t)).cpu()[None] for t in ids[17:]]
    tensors = {**st.persistent_tensors(), **st.ephemeral_tensors()}
    return torch.cat(rows), {k: tuple(t if t is None else t.cpu() for t in v)
                             for k, v in tensors.items()}


@pytest.mark.slow
def test_inference_through_triton_matches_reference():
    torch.manual_seed(0)
    model = KVTierLM(TINY).eval()
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2))
    with backend.use("reference"):
        want_logits, want_state = run(model, ids)
    if torch.cuda.is_available():
        where, model = contextlib.nullcontext(), model.cuda()
        ids = ids.cuda()
    else:
        where = interpret.interpreter()
    with where, backend.use("triton"):
        got_logits, got_state = run(model, ids)
    assert (got_logits - want_logits).abs().max().item() < 1e-3
    for name, (codes, scales) in want_state.items():
        other_codes, other_scales = got_state[name]
        # same inputs up to fp32 rounding: at most a rare one-step code difference
        assert codes.shape == other_codes.shape, name
        differ = (codes.float() != other_codes.float()).float().sum().item()
        assert differ <= 0.01 * codes.numel(), name
        if scales is not None:
            assert torch.allclose(scales.float(), other_scales.float(), rtol=1e-2), name
