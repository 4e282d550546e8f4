"""Inference attention: the backend KVTierLM.forward runs with over KVState caches.

`CachedAttention` serves one model call on a chunk of tokens ids (B, T), row b at
positions pos0s[b].. : window K/V are quantized to int8 per token and attended through
kernels.ops.window_attention next to the S window tokens the state already holds;
compressed entries are quantized to int4 when their block completes and read through
ops.sparse_compressed_attention; the two merge into one softmax through their lse.

append=True (prefill, decode_step) extends one session's state. append=False (replay,
replay_batch) runs a batch of sessions, each row at its own positions against its own
stored global KV (padded to the longest), and only rebuilds windows and tails. Every
state in a call holds a window of the same length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import ops
from model.config import ModelConfig
from model.net import Compressor, DecoderLayer, EncoderLayer
from model.state import KVState, QTensor


class CachedAttention:
    """The backend for one chunk ids (B, T) over the states `sts` (one per row); `want`
    ("last", "all", "none") names the rows the decoder runs on."""

    def __init__(self, cfg: ModelConfig, sts: list[KVState], ids: torch.Tensor,
                 pos0s: list[int], append: bool, want: str):
        (b, t), dev = ids.shape, ids.device
        if append and b != 1:
            raise ValueError("append advances one session at a time")
        self.cfg, self.sts, self.ids, self.append, self.want = cfg, sts, ids, append, want
        self.pos = torch.tensor(pos0s, device=dev).view(b, 1) + torch.arange(t, device=dev)
        m = cfg.block
        # entries per session before and after this chunk (replay appends none: 0 -> E)
        self.e_before = [st.n_entries if append else 0 for st in sts]
        self.e_after = [(p0 + t) // m if append else st.n_entries
                        for p0, st in zip(pos0s, sts, strict=True)]
        self.e_max = max(self.e_after)
        self.n_vis = (self.pos + 1) // m  # (B, T) entries visible per query
        s_prev = sts[0].window_len
        # The window mask depends on position differences only, and every row's window
        # starts at its own replay start (or is one session's), so row 0's positions serve
        # the batch.
        self.q_pos = self.pos[0]  # (T,)
        self.k_pos = torch.arange(pos0s[0] - s_prev, pos0s[0] + t, device=dev)  # (S + T,)
        self.keep = min(cfg.window, s_prev + t)  # window tokens the states keep
        # (B, Hkv, S + T, Dh) int8 + scales, of the layer being run (set by store_window)
        self.kk: QTensor
        self.vv: QTensor
        self.windows_k: list[QTensor] = []  # per layer: (B, keep, Hkv, Dh) int8 + scales
        self.windows_v: list[QTensor] = []
        self.latents: list[QTensor] = []  # per full layer: (B, E, Dc/2) uint8 + scales
        self.keys: list[QTensor] = []  # per full layer: (B, E, Di/2) uint8 + scales
        self.enc_tails: list[list[torch.Tensor]] = [[] for _ in sts]  # per session, per full layer
        # (B, T, P), (B, T, K) int32 entry ids, -1 unused (set by select)
        self.pool: torch.Tensor
        self.sel: torch.Tensor
        self.dec_latent: QTensor | None = None  # (B, E, Dc/2) uint8 + scales

    def store_window(self, layer: EncoderLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        i, gw = layer.index, self.cfg.window_group_size
        kq, vq = ops.quantize_int8(k, gw), ops.quantize_int8(v, gw)  # (B, Hkv, T, Dh[/gw])
        # states (S, Hkv, Dh) -> kernel (B, Hkv, S, Dh), then append the chunk's keys
        self.kk = _cat_q(_pair(lambda j: torch.stack([_window(st)[0][j][i].transpose(0, 1)
                                                        for st in self.sts])), kq, 2)
        self.vv = _cat_q(_pair(lambda j: torch.stack([_window(st)[1][j][i].transpose(0, 1)
                                                        for st in self.sts])), vq, 2)
        self.windows_k.append(_pair(lambda j: self.kk[j][:, :, -self.keep:].transpose(1, 2)))
        self.windows_v.append(_pair(lambda j: self.vv[j][:, :, -self.keep:].transpose(1, 2)))

    def add_entries(self, layer: EncoderLayer, x: torch.Tensor) -> None:
        f, g = self.cfg.full_layers.index(layer.index), self.cfg.group_size
        lat_rows, key_rows = [], []
        for s, st in enumerate(self.sts):
            span = (self.pos[s], self.e_before[s], self.e_after[s], self.append, g)
            enc_tail = _window(st)[2]
            new_lat, tail = _merge_rows(layer.latent, enc_tail[f], x[s], *span)
            new_key, _ = _merge_rows(layer.index_key, enc_tail[f], x[s], *span)
            self.enc_tails[s].append(tail)
            old_lat = _at(st.enc_latent, f)
            old_key = _at(st.enc_index_keys, f)
            lat_rows.append(old_lat if new_lat is None else _cat_q(old_lat, new_lat, 0))
            key_rows.append(old_key if new_key is None else _cat_q(old_key, new_key, 0))
        self.latents.append(_stack_padded(lat_rows, self.e_max))
        self.keys.append(_stack_padded(key_rows, self.e_max))

    def select(self, layer: EncoderLayer | DecoderLayer, x: torch.Tensor) -> None:
        cfg = self.cfg
        if layer.mode == "reindex":
            self.sel = _reindex(cfg, layer, x, self.pool, self.keys[-1])
        elif self.e_max == 0:
            b, t = x.shape[:2]
            self.pool = torch.full((b, t, cfg.pool), -1, dtype=torch.int32, device=x.device)
            self.sel = self.pool[..., : cfg.topk]
        else:
            qi, wts = layer.indexer(x)
            scores = ops.indexer_scores(qi, *self.keys[-1], wts, self.n_vis, cfg.group_size)
            # one ranking serves both: the top-k is the pool's prefix (same order, ties to
            # the lower index)
            self.pool = ops.indexer_topk(scores, cfg.pool)
            self.sel = self.pool[..., : cfg.topk]

    def encoder_attention(self, layer: EncoderLayer, q: torch.Tensor, qc: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        out_w, lse_w = ops.window_attention(q, *self.kk, *self.vv, self.q_pos, self.k_pos,
                                            cfg.window, cfg.window_group_size,
                                            layer.window_scale)
        out_c, lse_c = _compressed(cfg, layer, qc, self.latents[-1], self.sel)
        lse = torch.logaddexp(lse_w, lse_c)
        out_w = out_w * torch.exp(lse_w - lse).unsqueeze(-1)
        out_c = out_c * torch.exp(lse_c - lse).unsqueeze(-1)
        return out_w, out_c

    def global_kv(self, compressor: Compressor, normed: torch.Tensor) -> None:
        """dec.latent entries, then the chunk's windows, tails (and entries) into the states."""
        dec_rows = []
        for s, st in enumerate(self.sts):
            new_dec, dec_tail = _merge_rows(compressor, _window(st)[3][0], normed[s], self.pos[s],
                                            self.e_before[s], self.e_after[s], self.append,
                                            self.cfg.group_size)
            dec_latent = _at(st.dec_latent, 0)
            if new_dec is not None:
                dec_latent = _cat_q(dec_latent, new_dec, 0)
            dec_rows.append(dec_latent)
            st.window_k = _stacked_at(self.windows_k, s)
            st.window_v = _stacked_at(self.windows_v, s)
            st.enc_tail, st.dec_tail = torch.stack(self.enc_tails[s]), dec_tail[None]
        if self.append:
            st = self.sts[0]
            st.token_ids = torch.cat((st.token_ids, self.ids[0]))
            st.enc_latent = _pair(lambda j: torch.stack([lat[j][0] for lat in self.latents]))
            st.enc_index_keys = _pair(lambda j: torch.stack([key[j][0] for key in self.keys]))
            st.dec_latent = _pair(lambda j: dec_rows[0][j][None])
        self.dec_latent = _stack_padded(dec_rows, self.e_max)

    def decoder_rows(self, h: torch.Tensor) -> torch.Tensor | None:
        if self.want == "none":
            return None
        t = self.ids.shape[1]
        rows = slice(t - 1, t) if self.want == "last" else slice(None)
        self.pool, self.sel = self.pool[:, rows], self.sel[:, rows]
        return h[:, rows]

    def decoder_attention(self, layer: DecoderLayer, qc: torch.Tensor) -> torch.Tensor:
        assert self.dec_latent is not None  # global_kv ran first
        return _compressed(self.cfg, layer, qc, self.dec_latent, self.sel)[0]


def _cat_q(a: QTensor, b: QTensor, dim: int) -> QTensor:
    return torch.cat((a[0], b[0]), dim), torch.cat((a[1], b[1]), dim)


def _window(st: KVState) -> tuple[QTensor, QTensor, torch.Tensor, torch.Tensor]:
    """``st``'s window K/V and tails, which a batch needs (replay rebuilds them first)."""
    if st.window_k is None or st.window_v is None or st.enc_tail is None or st.dec_tail is None:
        raise ValueError("a state without its window: run model.infer.replay first")
    return st.window_k, st.window_v, st.enc_tail, st.dec_tail


def _at(q: QTensor, index: int) -> QTensor:
    return q[0][index], q[1][index]


def _stacked_at(qs: list[QTensor], index: int) -> QTensor:
    """Row ``index`` of each of ``qs``, stacked: (len(qs), ...) codes and scales."""
    return (torch.stack([q[0][index] for q in qs]), torch.stack([q[1][index] for q in qs]))


def _pair(part: Callable[[int], torch.Tensor]) -> QTensor:
    """(codes, scales): ``part(0)``, ``part(1)``."""
    return part(0), part(1)


def _stack_padded(rows: list[QTensor], length: int) -> QTensor:
    """Per-session (codes (E_b, ...), scales (E_b, ...)) -> (B, length, ...) pairs. Rows
    past a session's E_b are zeros that no query of that session sees (n_visible and the
    selections stop at E_b)."""
    if len(rows) == 1:
        return _pair(lambda j: rows[0][j][None])

    def padded(j: int) -> torch.Tensor:
        part = [row[j] for row in rows]
        out = part[0].new_zeros((len(part), length, *part[0].shape[1:]))
        for b, a in enumerate(part):
            out[b, :a.shape[0]] = a
        return out

    return _pair(padded)


def _reindex(cfg: ModelConfig, layer: EncoderLayer | DecoderLayer, x: torch.Tensor,
             pool: torch.Tensor, keys: QTensor) -> torch.Tensor:
    """Rescore a layer's own indexer queries inside the pool only (cost independent of
    context). x (B, T, width); pool (B, T, P) int32; keys (B, E, Di/2) uint8, (B, E, Di/g)
    fp16. Returns the selection (B, T, K) int32 of entry ids (-1 unused)."""
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


def _compressed(cfg: ModelConfig, layer: EncoderLayer | DecoderLayer, qc: torch.Tensor,
                latent: QTensor, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed sparse attention of qc (B, H, T, Dc) over the selected entries sel (B, T,
    K) of latent (B, E, Dc/2) uint8, (B, E, Dc/g) fp16. Returns out (B, H, T, Dc) and lse
    (B, H, T) (-inf, zero out where nothing is selected)."""
    if latent[0].shape[1] == 0:
        return torch.zeros_like(qc), torch.full(qc.shape[:-1], float("-inf"), device=qc.device)
    return ops.sparse_compressed_attention(qc, latent[0], latent[1], sel, cfg.group_size,
                                           layer.compressed_scale)


def _merge_rows(compressor: Compressor, tail: torch.Tensor, x: torch.Tensor, pos: torch.Tensor,
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
