"""Quantized inference: prefill, decode_step and the replay primitive (replay, replay_batch).

Every token goes through the model's one forward pass (KVTierLM.forward) with the cache
backend model.cache.CachedAttention, whether it arrives in a prefill chunk, a decode step
or a replay, so the three agree by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

from model.cache import CachedAttention
from model.net import KVTierLM
from model.state import KVState

LOGITS = ("last", "all", "none")


def _token_tensor(model: KVTierLM, token_ids) -> torch.Tensor:
    device = model.embed.weight.device
    ids = torch.as_tensor(token_ids, dtype=torch.int64, device=device).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= model.cfg.vocab):
        raise ValueError(f"token ids must lie in [0, {model.cfg.vocab})")
    return ids


@torch.no_grad()
@overload
def prefill(model: KVTierLM, token_ids: Sequence[int] | torch.Tensor,
            state: KVState | None = None, logits: Literal["last", "all"] = "last",
            chunk: int = 512) -> tuple[KVState, torch.Tensor]: ...


@overload
def prefill(model: KVTierLM, token_ids: Sequence[int] | torch.Tensor,
            state: KVState | None = None, *, logits: Literal["none"],
            chunk: int = 512) -> tuple[KVState, None]: ...


def prefill(model: KVTierLM, token_ids: Sequence[int] | torch.Tensor,
            state: KVState | None = None, logits: str = "last",
            chunk: int = 512) -> tuple[KVState, torch.Tensor | None]:
    """Run `token_ids` (sequence of ints or (T,) tensor) after `state` (default: empty).

    Returns the updated state and logits float32: (vocab,) for "last", (T, vocab) for
    "all", None for "none". The decoder runs only on the rows whose logits are returned.
    The state is updated in place (the same object is returned)."""
    if logits not in LOGITS:
        raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
    ids = _token_tensor(model, token_ids)
    if ids.numel() == 0:
        raise ValueError("prefill needs at least one token")
    st = KVState.empty(model.cfg, ids.device) if state is None else state
    if not st.has_window:
        raise ValueError("state has no window KV: rebuild it with replay() first")
    outs = []
    for start in range(0, ids.numel(), chunk):
        piece = ids[start:start + chunk]
        last = start + chunk >= ids.numel()
        want = logits if logits == "all" or last else "none"
        out = _forward(model, [st], piece[None], [st.n_tokens], append=True, want=want)
        if out is not None:
            outs.append(out)
    if logits == "none":
        return st, None
    return st, torch.cat(outs) if logits == "all" else outs[-1][-1]


@torch.no_grad()
def decode_step(model: KVTierLM, state: KVState, token_id: int) -> torch.Tensor:
    """Append one token to `state` (in place); returns its logits (vocab,) float32."""
    return prefill(model, [int(token_id)], state, logits="last")[1]


@torch.no_grad()
def replay(model: KVTierLM, state: KVState, r: int | None = None,
           chunk: int = 512) -> KVState:
    """Rebuild the window KV and tails of `state` by rerunning its last `r` tokens
    (default W) against the stored global KV; no global entry is appended again.

    The first replayed tokens see a truncated window (nothing before the replay start):
    that is the accepted approximation; r >= n_tokens % m is required for the tails.
    Returns a new state; the input is left as it was."""
    return replay_batch(model, [state], r, chunk)[0]


@torch.no_grad()
def replay_batch(model: KVTierLM, states: Sequence[KVState], r: int | None = None,
                 chunk: int = 512) -> list[KVState]:
    """`replay` of several sessions in one model call per group of equal effective R
    (min(r, n_tokens)): their token rows run as one batch, each reading its own global
    KV. Returns the new states in the order given; the inputs are left as they were."""
    cfg = model.cfg
    r = cfg.window if r is None else r
    if r < 1 or not states:
        raise ValueError(f"replay needs r >= 1 and at least one state (r={r})")
    for st in states:
        n = st.n_tokens
        if n == 0:
            raise ValueError("replay needs a non-empty state")
        if min(r, n) < n % cfg.block:
            raise ValueError(f"r={min(r, n)} is shorter than the unmerged tail "
                             f"({n % cfg.block} tokens)")
    groups: dict[int, list[int]] = {}
    for i, st in enumerate(states):
        groups.setdefault(min(r, st.n_tokens), []).append(i)
    out: list[KVState | None] = [None] * len(states)
    for rg, members in groups.items():
        for i, st in zip(members, _replay_group(model, [states[i] for i in members], rg,
                                                chunk), strict=True):
            out[i] = st
    return [st for st in out if st is not None]  # every index is in one group


def _replay_group(model: KVTierLM, states: list[KVState], r: int,
                  chunk: int) -> list[KVState]:
    """Replay of sessions sharing R: fresh states that hold each session's global KV and
    an empty window, advanced chunk by chunk over each session's last R tokens."""
    sts = []
    for state in states:
        empty = KVState.empty(model.cfg, state.token_ids.device)
        sts.append(KVState(model.cfg, state.token_ids, state.enc_latent,
                           state.enc_index_keys, state.dec_latent, empty.window_k,
                           empty.window_v, empty.enc_tail, empty.dec_tail))
    ids = torch.stack([st.token_ids[st.n_tokens - r:] for st in sts])  # (B, R)
    for start in range(0, r, chunk):
        _forward(model, sts, ids[:, start:start + chunk],
                 [st.n_tokens - r + start for st in sts], append=False, want="none")
    for st in sts:
        st.validate()
    return sts


def _forward(model: KVTierLM, sts: list[KVState], ids: torch.Tensor, pos0s: list[int],
             append: bool, want: str) -> torch.Tensor | None:
    """One forward pass over ids (B, T), row b at positions pos0s[b].. (see CachedAttention);
    returns the first row's logits (T', vocab) float32 for `want`, None for "none"."""
    logits = model(ids, CachedAttention(model.cfg, sts, ids, pos0s, append, want))
    return None if logits is None else logits[0].float()
