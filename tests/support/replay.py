"""Shared by the replay tests: a tiny model with its layout registered, and sessions."""

from __future__ import annotations

import torch

from kvstore.format.registry import register_layout
from model.config import TINY, layout_spec
from model.infer import prefill
from model.net import KVTierLM
from replay.state_codec import state_to_chunks

TINY_SPEC = register_layout(layout_spec(TINY, name="kvtier-tiny-test"))  # W 8, m 4, chunk 16


def tiny_model(seed: int = 0) -> KVTierLM:
    torch.manual_seed(seed)
    return KVTierLM(TINY).eval()


def tiny_session(model: KVTierLM, n: int, seed: int = 1):
    """(state, chunks as bytes, tail) of a prefilled session of n random tokens."""
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
    state = prefill(model, ids, logits="none")[0]
    chunks, tail, _ = state_to_chunks(TINY_SPEC, state)
    return state, [c for _, c in chunks], tail
