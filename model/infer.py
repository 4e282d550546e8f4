"""Quantized inference through kernels.ops: prefill, decode_step and the replay primitive.

Every token goes through one routine, `_advance`, whether it arrives in a prefill chunk, a
decode step or a replay, so the three agree by construction: window K/V are quantized to
int8 per token, compressed entries to int4 when their block completes, and each encoder
layer merges its window and compressed attention into one softmax through their lse.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import ops
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
def prefill(model: KVTierLM, token_ids, state: KVState | None = None, logits: str = "last",
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
        out = _advance(model, [st], piece[None], [st.n_tokens], append=True, want=want)
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
    return out


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
        _advance(model, sts, ids[:, start:start + chunk],
                 [st.n_tokens - r + start for st in sts], append=False, want="none")
    for st in sts:
        st.validate()
    return sts


def _cat_q(a: tuple, b: tuple, dim: int) -> tuple:
    return torch.cat((a[0], b[0]), dim), torch.cat((a[1], b[1]), dim)


def _stack_padded(rows: list[tuple], length: int) -> tuple:
    """Per-session (codes (E_b, ...), scales (E_b, ...)) -> (B, length, ...) pairs. Rows
    past a session's E_b are zeros that no query of that session sees (n_visible and the
    selections stop at E_b)."""
    if len(rows) == 1:
        return tuple(a[None] for a in rows[0])
    out = []
    for part in zip(*rows, strict=True):
        padded = part[0].new_zeros((len(part), length, *part[0].shape[1:]))
        for b, a in enumerate(part):
            padded[b, :a.shape[0]] = a
        out.append(padded)
    return tuple(out)


def _reindex(model: KVTierLM, layer, x: torch.Tensor, pool: torch.Tensor,
             keys: tuple) -> torch.Tensor:
    """Rescore a layer's own indexer queries inside the pool only (cost independent of
    context). x (B, T, width); pool (B, T, P) int32; keys (B, E, Di/2) uint8, (B, E, Di/g)
    fp16. Returns the selection (B, T, K) int32 of entry ids (-1 unused)."""
    cfg = model.cfg
    b, t, p = pool.shape
    if keys[0].shape[1] == 0:
        return torch.full((b, t, cfg.topk), -1, dtype=torch.int32, device=pool.device)
    qi, wts = layer.indexer(x)
    # order candidates by entry id (-1 last) so score ties go to the lower entry id
    big = torch.iinfo(torch.int32).max
    pool = torch.sort(torch.where(pool < 0, big, pool), dim=-1).values
    pool = torch.where(pool == big, -1, pool)
    flat = pool.clamp_min(0).long()  # (B, T, P)
    rows = torch.arange(b, device=pool.device).view(b, 1, 1)
    # one "batch" per query: its P candidate keys
    scores = ops.indexer_scores(qi.flatten(0, 1).unsqueeze(1),
                                keys[0][rows, flat].flatten(0, 1),
                                keys[1][rows, flat].flatten(0, 1),
                                wts.flatten(0, 1).unsqueeze(1),
                                torch.full((1,), p, device=pool.device),
                                cfg.group_size).view(b, t, p)
    order = ops.indexer_topk(scores.masked_fill(pool < 0, float("-inf")), cfg.topk)
    picked = torch.gather(pool, -1, order.clamp_min(0).long())
    return torch.where(order >= 0, picked, torch.full_like(picked, -1))


def _compressed(model: KVTierLM, layer, x: torch.Tensor, latent: tuple,
                sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed sparse attention; latent (B, E, Dc/2) uint8, (B, E, Dc/g) fp16. Returns
    out (B, H, T, Dc) and lse (B, H, T) (-inf, zero out where nothing is selected)."""
    cfg = model.cfg
    qc = model.compressed_q(layer, x)
    if latent[0].shape[1] == 0:
        return torch.zeros_like(qc), torch.full(qc.shape[:-1], float("-inf"), device=qc.device)
    return ops.sparse_compressed_attention(qc, latent[0], latent[1], sel, cfg.group_size,
                                           model.compressed_scale())


def _merge_rows(compressor, tail: torch.Tensor, x: torch.Tensor, pos: torch.Tensor,
                entries_before: int, entries_after: int, append: bool, group_size: int):
    """Fold new normed rows x (T, width) of one session into its block tail (t, width) bf16.

    append: complete blocks become new int4 entries ((k, D/2) uint8, (k, D/g) fp16).
    replay: entries already exist; only rows of the incomplete last block are kept.
    Returns (new entries or None, new tail)."""
    m = compressor.proj.in_features // x.shape[-1]
    rows = x.to(torch.bfloat16)
    if not append:
        return None, torch.cat((tail, rows[pos >= entries_after * m]))
    rows = torch.cat((tail, rows))
    done = (entries_after - entries_before) * m
    entries = None
    if done:
        entries = ops.quantize_int4(compressor(rows[:done].reshape(-1, m * x.shape[-1])),
                                    group_size)
    return entries, rows[done:]


def _advance(model: KVTierLM, sts: list[KVState], ids: torch.Tensor, pos0s: list[int],
             append: bool, want: str) -> torch.Tensor | None:
    """Run tokens ids (B, T), row b at positions pos0s[b].., through the encoder (and the
    decoder for the wanted rows). append=True extends the state (one session);
    append=False (replay) only rebuilds the windows and tails, reading entries the states
    already hold. Every state holds a window of the same length."""
    cfg = model.cfg
    m, gw, g = cfg.block, cfg.window_group_size, cfg.group_size
    b, t = ids.shape
    if append and b != 1:
        raise ValueError("append advances one session at a time")
    dev = ids.device
    pos = torch.tensor(pos0s, device=dev).view(b, 1) + torch.arange(t, device=dev)  # (B, T)
    e_before = [st.n_entries if append else 0 for st in sts]
    e_after = [(p0 + t) // m if append else st.n_entries for p0, st in zip(pos0s, sts,
                                                                            strict=True)]
    e_max = max(e_after)
    n_vis = (pos + 1) // m  # (B, T)
    s_prev = sts[0].window_len
    # The window mask depends on position differences only, and every row's window starts
    # at its own replay start (or is one session's), so row 0's positions serve the batch.
    q_pos = pos[0]
    k_pos = torch.arange(pos0s[0] - s_prev, pos0s[0] + t, device=dev)
    keep = min(cfg.window, s_prev + t)

    latents, keys, windows_k, windows_v = [], [], [], []
    enc_tails: list[list[torch.Tensor]] = [[] for _ in sts]
    h = model.embed(ids)  # (B, T, width)
    pool = sel = None
    for i, layer in enumerate(model.encoder):
        x = layer.norm(h)
        q, k, v = model.window_qkv(layer, x, pos)
        kq, vq = ops.quantize_int8(k, gw), ops.quantize_int8(v, gw)  # (B, Hkv, T, Dh[/gw])
        # states (S, Hkv, Dh) -> kernel (B, Hkv, S, Dh), then append the chunk's keys
        kk = _cat_q(tuple(torch.stack([st.window_k[j][i].transpose(0, 1) for st in sts])
                          for j in range(2)), kq, 2)
        vv = _cat_q(tuple(torch.stack([st.window_v[j][i].transpose(0, 1) for st in sts])
                          for j in range(2)), vq, 2)
        out_w, lse_w = ops.window_attention(q, kk[0], kk[1], vv[0], vv[1], q_pos, k_pos,
                                            cfg.window, gw, model.window_scale())
        windows_k.append(tuple(a[:, :, -keep:].transpose(1, 2) for a in kk))
        windows_v.append(tuple(a[:, :, -keep:].transpose(1, 2) for a in vv))
        if layer.mode == "full":
            f = len(latents)
            lat_rows, key_rows = [], []
            for s, st in enumerate(sts):
                new_lat, tail = _merge_rows(layer.latent, st.enc_tail[f], x[s], pos[s],
                                            e_before[s], e_after[s], append, g)
                new_key, _ = _merge_rows(layer.index_key, st.enc_tail[f], x[s], pos[s],
                                         e_before[s], e_after[s], append, g)
                enc_tails[s].append(tail)
                old_lat = tuple(a[f] for a in st.enc_latent)
                old_key = tuple(a[f] for a in st.enc_index_keys)
                lat_rows.append(old_lat if new_lat is None else _cat_q(old_lat, new_lat, 0))
                key_rows.append(old_key if new_key is None else _cat_q(old_key, new_key, 0))
            latents.append(_stack_padded(lat_rows, e_max))
            keys.append(_stack_padded(key_rows, e_max))
            if e_max == 0:
                pool = torch.full((b, t, cfg.pool), -1, dtype=torch.int32, device=dev)
                sel = pool[..., : cfg.topk]
            else:
                qi, wts = layer.indexer(x)
                scores = ops.indexer_scores(qi, keys[-1][0], keys[-1][1], wts, n_vis, g)
                # one ranking serves both: the top-k is the pool's prefix (same order, ties
                # to the lower index)
                pool = ops.indexer_topk(scores, cfg.pool)
                sel = pool[..., : cfg.topk]
        elif layer.mode == "reindex":
            sel = _reindex(model, layer, x, pool, keys[-1])
        out_c, lse_c = _compressed(model, layer, x, latents[-1], sel)
        lse = torch.logaddexp(lse_w, lse_c)
        out_w = out_w * torch.exp(lse_w - lse).unsqueeze(-1)
        out_c = out_c * torch.exp(lse_c - lse).unsqueeze(-1)
        h = h + model.merge_out(layer, out_c, out_w)
        h = h + layer.mlp(layer.mlp_norm(h))

    normed = model.enc_norm(h)
    dec_rows = []
    for s, st in enumerate(sts):
        new_dec, dec_tail = _merge_rows(model.dec_latent, st.dec_tail[0], normed[s], pos[s],
                                        e_before[s], e_after[s], append, g)
        dec_latent = tuple(a[0] for a in st.dec_latent)
        if new_dec is not None:
            dec_latent = _cat_q(dec_latent, new_dec, 0)
        dec_rows.append(dec_latent)
        st.window_k = tuple(torch.stack([w[j][s] for w in windows_k]) for j in range(2))
        st.window_v = tuple(torch.stack([w[j][s] for w in windows_v]) for j in range(2))
        st.enc_tail, st.dec_tail = torch.stack(enc_tails[s]), dec_tail[None]
    if append:
        st = sts[0]
        st.token_ids = torch.cat((st.token_ids, ids[0]))
        st.enc_latent = tuple(torch.stack([lat[j][0] for lat in latents]) for j in range(2))
        st.enc_index_keys = tuple(torch.stack([key[j][0] for key in keys]) for j in range(2))
        st.dec_latent = tuple(a[None] for a in dec_rows[0])
    if want == "none":
        return None
    rows = slice(t - 1, t) if want == "last" else slice(None)
    return _decode(model, h[:, rows], pool[:, rows], sel[:, rows], keys[-1],
                   _stack_padded(dec_rows, e_max))


def _decode(model: KVTierLM, h: torch.Tensor, pool: torch.Tensor, sel: torch.Tensor,
            keys: tuple, dec_latent: tuple) -> torch.Tensor:
    """Decoder over the wanted rows h (1, T', width) -> logits (T', vocab); pool (1, T', P),
    sel (1, T', K), keys and dec_latent (1, E, ...) pairs. Layers read the shared
    dec.latent; a "reindex" layer rescores the encoder's last pool with its own queries,
    "reuse" keeps the previous selection (the encoder's last, at first)."""
    for layer in model.decoder:
        x = layer.norm(h)
        if layer.mode == "reindex":
            sel = _reindex(model, layer, x, pool, keys)
        out_c, _ = _compressed(model, layer, x, dec_latent, sel)
        h = h + model.merge_out(layer, out_c)
        h = h + layer.mlp(layer.mlp_norm(h))
    return model.logits(h)[0].float()
