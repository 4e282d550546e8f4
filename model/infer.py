"""Quantized inference through kernels.ops: prefill, decode_step and the replay primitive.

Every token goes through one routine, `_advance`, whether it arrives in a prefill chunk, a
decode step or a replay, so the three agree by construction: window K/V are quantized to
int8 per token, compressed entries to int4 when their block completes, and each encoder
layer merges its window and compressed attention into one softmax through their lse.
"""

from __future__ import annotations

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
        out = _advance(model, st, piece, st.n_tokens, append=True, want=want)
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
    cfg = model.cfg
    r = cfg.window if r is None else r
    n = state.n_tokens
    if r < 1 or n == 0:
        raise ValueError(f"replay needs r >= 1 and a non-empty state (r={r}, n={n})")
    r = min(r, n)
    if r < n % cfg.block:
        raise ValueError(f"r={r} is shorter than the unmerged tail ({n % cfg.block} tokens)")
    empty = KVState.empty(cfg, state.token_ids.device)
    st = KVState(cfg, state.token_ids, state.enc_latent, state.enc_index_keys,
                 state.dec_latent, empty.window_k, empty.window_v, empty.enc_tail,
                 empty.dec_tail)
    ids = state.token_ids[n - r:]
    for start in range(0, r, chunk):
        _advance(model, st, ids[start:start + chunk], n - r + start, append=False, want="none")
    st.validate()
    return st


def _cat_q(a: tuple, b: tuple, dim: int) -> tuple:
    return torch.cat((a[0], b[0]), dim), torch.cat((a[1], b[1]), dim)


def _reindex(model: KVTierLM, layer, x: torch.Tensor, pool: torch.Tensor,
             keys: tuple) -> torch.Tensor:
    """Rescore a layer's own indexer queries inside the pool only (cost independent of
    context). x (1, T, width); pool (1, T, P) int32; keys (E, Di/2) uint8, (E, Di/g) fp16.
    Returns the selection (1, T, K) int32 of entry ids (-1 unused)."""
    cfg = model.cfg
    t, p = pool.shape[1], pool.shape[2]
    if keys[0].shape[0] == 0:
        return torch.full((1, t, cfg.topk), -1, dtype=torch.int32, device=pool.device)
    qi, wts = layer.indexer(x)
    # order candidates by entry id (-1 last) so score ties go to the lower entry id
    big = torch.iinfo(torch.int32).max
    pool = torch.sort(torch.where(pool < 0, big, pool), dim=-1).values
    pool = torch.where(pool == big, -1, pool)
    flat = pool[0].clamp_min(0).long()  # (T, P)
    # one "batch" per query: its P candidate keys
    scores = ops.indexer_scores(qi[0].unsqueeze(1), keys[0][flat], keys[1][flat],
                                wts[0].unsqueeze(1), torch.full((1,), p, device=pool.device),
                                cfg.group_size).view(1, t, p)
    order = ops.indexer_topk(scores.masked_fill(pool < 0, float("-inf")), cfg.topk)
    picked = torch.gather(pool, -1, order.clamp_min(0).long())
    return torch.where(order >= 0, picked, torch.full_like(picked, -1))


def _compressed(model: KVTierLM, layer, x: torch.Tensor, latent: tuple,
                sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed sparse attention; latent (E, Dc/2) uint8, (E, Dc/g) fp16. Returns out
    (1, H, T, Dc) and lse (1, H, T) (-inf, zero out where nothing is selected)."""
    cfg = model.cfg
    qc = model.compressed_q(layer, x)
    if latent[0].shape[0] == 0:
        return torch.zeros_like(qc), torch.full(qc.shape[:-1], float("-inf"), device=qc.device)
    return ops.sparse_compressed_attention(qc, latent[0][None], latent[1][None], sel,
                                           cfg.group_size, model.compressed_scale())


def _merge_rows(compressor, tail: torch.Tensor, x: torch.Tensor, pos: torch.Tensor,
                entries_before: int, entries_after: int, append: bool, group_size: int):
    """Fold new normed rows x (T, width) into the block tail (t, width) bf16.

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


def _advance(model: KVTierLM, st: KVState, ids: torch.Tensor, pos0: int, append: bool,
             want: str) -> torch.Tensor | None:
    """Run tokens ids (T,) at positions pos0.. through the encoder (and the decoder for the
    wanted rows). append=True extends the state; append=False (replay) only rebuilds the
    window and tails, reading entries the state already holds."""
    cfg = model.cfg
    m, gw, g = cfg.block, cfg.window_group_size, cfg.group_size
    t = ids.numel()
    pos = torch.arange(pos0, pos0 + t, device=ids.device)
    e_before = st.n_entries if append else 0
    e_after = (pos0 + t) // m if append else st.n_entries
    n_vis = (pos + 1) // m
    s_prev = st.window_len
    k_pos = torch.arange(pos0 - s_prev, pos0 + t, device=ids.device)
    keep = min(cfg.window, s_prev + t)

    latents, keys, windows_k, windows_v, enc_tails = [], [], [], [], []
    h = model.embed(ids)[None]  # (1, T, width)
    pool = sel = None
    for i, layer in enumerate(model.encoder):
        x = layer.norm(h)
        q, k, v = model.window_qkv(layer, x, pos)
        kq, vq = ops.quantize_int8(k, gw), ops.quantize_int8(v, gw)  # (1, Hkv, T, Dh[/gw])
        # state (S, Hkv, Dh) -> kernel (1, Hkv, S, Dh), then append the chunk's keys
        kk = _cat_q(tuple(a[i].transpose(0, 1)[None] for a in st.window_k), kq, 2)
        vv = _cat_q(tuple(a[i].transpose(0, 1)[None] for a in st.window_v), vq, 2)
        out_w, lse_w = ops.window_attention(q, kk[0], kk[1], vv[0], vv[1], pos, k_pos,
                                            cfg.window, gw, model.window_scale())
        windows_k.append(tuple(a[0, :, -keep:].transpose(0, 1) for a in kk))
        windows_v.append(tuple(a[0, :, -keep:].transpose(0, 1) for a in vv))
        if layer.mode == "full":
            f = len(latents)
            new_lat, tail = _merge_rows(layer.latent, st.enc_tail[f], x[0], pos, e_before,
                                        e_after, append, g)
            new_key, _ = _merge_rows(layer.index_key, st.enc_tail[f], x[0], pos, e_before,
                                     e_after, append, g)
            enc_tails.append(tail)
            old_lat = tuple(a[f] for a in st.enc_latent)
            old_key = tuple(a[f] for a in st.enc_index_keys)
            latents.append(old_lat if new_lat is None else _cat_q(old_lat, new_lat, 0))
            keys.append(old_key if new_key is None else _cat_q(old_key, new_key, 0))
            if e_after == 0:
                pool = torch.full((1, t, cfg.pool), -1, dtype=torch.int32, device=ids.device)
                sel = pool[..., : cfg.topk]
            else:
                qi, wts = layer.indexer(x)
                scores = ops.indexer_scores(qi, keys[-1][0][None], keys[-1][1][None], wts,
                                            n_vis, g)
                pool, sel = ops.indexer_topk(scores, cfg.pool), ops.indexer_topk(scores, cfg.topk)
        elif layer.mode == "reindex":
            sel = _reindex(model, layer, x, pool, keys[-1])
        out_c, lse_c = _compressed(model, layer, x, latents[-1], sel)
        lse = torch.logaddexp(lse_w, lse_c)
        out_w = out_w * torch.exp(lse_w - lse).unsqueeze(-1)
        out_c = out_c * torch.exp(lse_c - lse).unsqueeze(-1)
        h = h + model.merge_out(layer, out_c, out_w)
        h = h + layer.mlp(layer.mlp_norm(h))

    new_dec, dec_tail = _merge_rows(model.dec_latent, st.dec_tail[0], model.enc_norm(h)[0],
                                    pos, e_before, e_after, append, g)
    dec_latent = tuple(a[0] for a in st.dec_latent)
    if new_dec is not None:
        dec_latent = _cat_q(dec_latent, new_dec, 0)
    st.window_k = tuple(torch.stack(list(parts)) for parts in zip(*windows_k, strict=True))
    st.window_v = tuple(torch.stack(list(parts)) for parts in zip(*windows_v, strict=True))
    st.enc_tail, st.dec_tail = torch.stack(enc_tails), dec_tail[None]
    if append:
        st.token_ids = torch.cat((st.token_ids, ids))
        st.enc_latent = tuple(torch.stack(list(p)) for p in zip(*latents, strict=True))
        st.enc_index_keys = tuple(torch.stack(list(p)) for p in zip(*keys, strict=True))
        st.dec_latent = tuple(a[None] for a in dec_latent)
    if want == "none":
        return None
    rows = slice(t - 1, t) if want == "last" else slice(None)
    return _decode(model, h[:, rows], pool[:, rows], sel[:, rows], keys[-1], dec_latent)


def _decode(model: KVTierLM, h: torch.Tensor, pool: torch.Tensor, sel: torch.Tensor,
            keys: tuple, dec_latent: tuple) -> torch.Tensor:
    """Decoder over the wanted rows h (1, T', width) -> logits (T', vocab). Layers read the
    shared dec.latent; a "reindex" layer rescores the encoder's last pool with its own
    queries, "reuse" keeps the previous selection (the encoder's last, at first)."""
    for layer in model.decoder:
        x = layer.norm(h)
        if layer.mode == "reindex":
            sel = _reindex(model, layer, x, pool, keys)
        out_c, _ = _compressed(model, layer, x, dec_latent, sel)
        h = h + model.merge_out(layer, out_c)
        h = h + layer.mlp(layer.mlp_norm(h))
    return model.logits(h)[0].float()
