"""The bundled model, read top to bottom: its layers and the one forward pass that training,
prefill, decode and replay all run.

    KVTierLM.forward: embed -> encoder layers -> global KV (dec.latent) -> decoder layers
                      -> logits

Encoder layer: pre-norm; one softmax per head over two key sets — the exact window keys
(rotary, int8) and the selected compressed entries (position-free, int4) — then an MLP.
Decoder layer: pre-norm; the same softmax over the decoder's shared compressed entries
only (its local context arrives through the encoder's residual stream), then an MLP.

Where keys live and how attention reads them is the one thing training and inference do
differently, so the forward takes it as an `Attention` backend: model/dense.py's
`TrainingAttention` (whole sequences, float, straight-through fake quantization) or
model/cache.py's `CachedAttention` (int8/int4 caches in KVState, chunks at any position,
a batch of sessions for replay). The layer maths here is shared by both.

Shapes: B batch rows, T tokens in the rows being run, H query heads, Hkv window K/V heads,
Dh window head dim, Dc compressed latent dim, width the residual stream.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """x (..., T, D) with pos (T,) int64 -> x rotated by position (half-split pairs).
    x (B, H, T, D) may take pos (B, T): one position vector per batch row."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angle = pos.to(torch.float32).unsqueeze(-1) * freq  # (T, half) or (B, T, half)
    if pos.dim() == 2:
        angle = angle.unsqueeze(1)  # (B, 1, T, half): shared by the heads
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Indexer(nn.Module):
    """Per-query indexer heads: queries (..., Hi, Di) and head weights (..., Hi)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hi, self.di = cfg.index_heads, cfg.index_dim
        self.q = nn.Linear(cfg.width, cfg.index_heads * cfg.index_dim, bias=False)
        self.w = nn.Linear(cfg.width, cfg.index_heads, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The indexer reads a detached input: its auxiliary loss trains only its own weights.
        x = x.detach()
        qi = self.q(x).unflatten(-1, (self.hi, self.di))
        return qi, self.w(x) / math.sqrt(self.hi)


class Compressor(nn.Module):
    """Merges m consecutive (normed) rows into one entry vector: (..., m*width) -> (..., out)."""

    def __init__(self, cfg: ModelConfig, out_dim: int, detach: bool = False):
        super().__init__()
        self.proj = nn.Linear(cfg.block * cfg.width, out_dim, bias=False)
        self.detach = detach  # index keys learn only from the indexer's loss

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        # Rows are rounded to bf16 first: the inference path keeps the incomplete block's
        # rows (the tail) in bf16, so training must see the same rounding.
        blocks = blocks.to(torch.bfloat16).float()
        return self.proj(blocks.detach() if self.detach else blocks)


class Attention(Protocol):
    """What a forward pass asks of its backend, in the order it asks (see KVTierLM.forward)."""

    pos: torch.Tensor  # (T,) or (B, T) int64: positions of the rows being run

    def store_window(self, layer: EncoderLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        """This layer's window keys and values (B, Hkv, T, Dh), rotary applied."""

    def add_entries(self, layer: EncoderLayer, x: torch.Tensor) -> None:
        """A full layer's normed rows x (B, T, width): compressed entries and index keys of
        the blocks they complete."""

    def select(self, layer: EncoderLayer | DecoderLayer, x: torch.Tensor) -> None:
        """The entries this layer's queries attend to: a full layer scores every visible
        entry (pool and top-k), a reindex layer rescores the pool; reuse layers skip it."""

    def encoder_attention(self, layer: EncoderLayer, q: torch.Tensor, qc: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, T, Dh), qc (B, H, T, Dc) -> out_w (B, H, T, Dh), out_c (B, H, T, Dc):
        the two key sets' outputs, each weighted by its share of the one softmax."""

    def global_kv(self, compressor: Compressor, normed: torch.Tensor) -> None:
        """The normed encoder output (B, T, width): dec.latent entries of completed blocks."""

    def decoder_rows(self, h: torch.Tensor) -> torch.Tensor | None:
        """h (B, T, width) -> the rows (B, T', width) whose logits are wanted; None: none."""

    def decoder_attention(self, layer: DecoderLayer, qc: torch.Tensor) -> torch.Tensor:
        """qc (B, H, T', Dc) -> out_c (B, H, T', Dc) over the selected dec.latent entries."""


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mode: str, index: int):
        super().__init__()
        self.mode, self.index = mode, index
        h, hkv, dh, dc = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.latent_dim
        self.heads, self.kv_heads, self.head_dim, self.latent_dim = h, hkv, dh, dc
        self.rope_base = cfg.rope_base
        self.window_scale, self.compressed_scale = dh ** -0.5, dc ** -0.5
        self.norm = RMSNorm(cfg.width)
        self.wq = nn.Linear(cfg.width, h * dh, bias=False)
        self.wkv = nn.Linear(cfg.width, 2 * hkv * dh, bias=False)
        self.wo = nn.Linear(h * dh, cfg.width, bias=False)
        self.wqc = nn.Linear(cfg.width, h * dc, bias=False)
        self.woc = nn.Linear(h * dc, cfg.width, bias=False)
        if mode == "full":
            self.latent = Compressor(cfg, dc)
            self.index_key = Compressor(cfg, cfg.index_dim, detach=True)
        if mode in ("full", "reindex"):
            self.indexer = Indexer(cfg)
        self.mlp_norm = RMSNorm(cfg.width)
        self.mlp = MLP(cfg.width, cfg.mlp_hidden)

    def forward(self, h: torch.Tensor, attn: Attention) -> torch.Tensor:
        """h (B, T, width) float residual stream -> the same, this layer added."""
        # The call order below is also the order training builds its autograd graph in,
        # which fixes how gradients sum up: reordering it can change the trained weights.
        x = self.norm(h)  # (B, T, width)
        q, k, v = self.window_qkv(x, attn.pos)  # (B, H, T, Dh), (B, Hkv, T, Dh) x 2
        attn.store_window(self, k, v)
        if self.mode == "full":
            attn.add_entries(self, x)
        if self.mode != "reuse":
            attn.select(self, x)
        out_w, out_c = attn.encoder_attention(self, q, compressed_q(self, x))
        h = h + merge_out(self, out_c, out_w)
        return h + self.mlp(self.mlp_norm(h))

    def window_qkv(self, x: torch.Tensor, pos: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, width) normed, pos (T,) or (B, T) -> q (B, H, T, Dh), k and v (B, Hkv, T,
        Dh), rotary applied."""
        q = self.wq(x).unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        kv = self.wkv(x).unflatten(-1, (2, self.kv_heads, self.head_dim))
        k, v = kv[..., 0, :, :].transpose(1, 2), kv[..., 1, :, :].transpose(1, 2)
        return rotary(q, pos, self.rope_base), rotary(k, pos, self.rope_base), v


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mode: str):
        super().__init__()
        self.mode = mode
        self.heads, self.latent_dim = cfg.heads, cfg.latent_dim
        self.compressed_scale = cfg.latent_dim ** -0.5
        self.norm = RMSNorm(cfg.width)
        self.wqc = nn.Linear(cfg.width, cfg.heads * cfg.latent_dim, bias=False)
        self.woc = nn.Linear(cfg.heads * cfg.latent_dim, cfg.width, bias=False)
        if mode == "reindex":
            self.indexer = Indexer(cfg)
        self.mlp_norm = RMSNorm(cfg.width)
        self.mlp = MLP(cfg.width, cfg.mlp_hidden)

    def forward(self, h: torch.Tensor, attn: Attention) -> torch.Tensor:
        """h (B, T', width) float, the rows whose logits are wanted -> the same, updated."""
        x = self.norm(h)  # (B, T', width)
        if self.mode == "reindex":
            attn.select(self, x)
        h = h + merge_out(self, attn.decoder_attention(self, compressed_q(self, x)))
        return h + self.mlp(self.mlp_norm(h))


def compressed_q(layer: EncoderLayer | DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    """x (B, T, width) -> q (B, H, T, Dc) against the compressed entries."""
    return layer.wqc(x).unflatten(-1, (layer.heads, layer.latent_dim)).transpose(1, 2)


def merge_out(layer: EncoderLayer | DecoderLayer, out_c: torch.Tensor,
              out_w: torch.Tensor | None = None) -> torch.Tensor:
    """Already-weighted path outputs (B, H, T, D*) -> residual update (B, T, width)."""
    y = layer.woc(out_c.transpose(1, 2).flatten(2))
    if out_w is not None:
        assert isinstance(layer, EncoderLayer)  # only an encoder layer has a window path
        y = y + layer.wo(out_w.transpose(1, 2).flatten(2))
    return y


class KVTierLM(nn.Module):
    """Byte-level causal encoder/decoder LM with window + compressed sparse attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.encoder = nn.ModuleList(EncoderLayer(cfg, m, i) for i, m in enumerate(cfg.enc_modes))
        self.enc_norm = RMSNorm(cfg.width)
        self.dec_latent = Compressor(cfg, cfg.latent_dim)
        self.decoder = nn.ModuleList(DecoderLayer(cfg, m) for m in cfg.dec_modes)
        self.out_norm = RMSNorm(cfg.width)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=module.in_features ** -0.5)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=1.0)

    def forward(self, ids: torch.Tensor, attn: Attention) -> torch.Tensor | None:
        """ids (B, T) int64 at positions attn.pos -> logits (B, T', vocab) of the rows
        attn.decoder_rows keeps (every row in training), or None when it keeps none."""
        h = self.embed(ids)  # (B, T, width): the residual stream
        for layer in self.encoder:
            h = layer(h, attn)
        attn.global_kv(self.dec_latent, self.enc_norm(h))
        h = attn.decoder_rows(h)  # (B, T', width): the decoder runs only where logits are wanted
        if h is None:
            return None
        for layer in self.decoder:
            h = layer(h, attn)
        return self.logits(h)  # (B, T', vocab)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden (..., width) -> logits (..., vocab); the head is tied to the embedding."""
        return self.out_norm(h) @ self.embed.weight.t() / math.sqrt(self.cfg.width)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
