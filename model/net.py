"""Parameters of the bundled model and the per-token maths shared by training and inference.

Encoder layer: pre-norm; one softmax per head over two key sets — the exact window keys
(rotary, int8) and the selected compressed entries (position-free, int4) — then an MLP.
Decoder layer: pre-norm; the same softmax over the decoder's shared compressed entries
only (its local context arrives through the encoder's residual stream), then an MLP.

The training forward (model/dense.py) and the quantized inference path (model/infer.py)
both call the projections defined here, so they compute the same function.
"""

from __future__ import annotations

import math

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


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mode: str):
        super().__init__()
        self.mode = mode
        h, hkv, dh, dc = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.latent_dim
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


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mode: str):
        super().__init__()
        self.mode = mode
        self.norm = RMSNorm(cfg.width)
        self.wqc = nn.Linear(cfg.width, cfg.heads * cfg.latent_dim, bias=False)
        self.woc = nn.Linear(cfg.heads * cfg.latent_dim, cfg.width, bias=False)
        if mode == "reindex":
            self.indexer = Indexer(cfg)
        self.mlp_norm = RMSNorm(cfg.width)
        self.mlp = MLP(cfg.width, cfg.mlp_hidden)


class KVTierLM(nn.Module):
    """Byte-level causal encoder/decoder LM with window + compressed sparse attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.encoder = nn.ModuleList(EncoderLayer(cfg, m) for m in cfg.enc_modes)
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

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden (..., width) -> logits (..., vocab); the head is tied to the embedding."""
        return self.out_norm(h) @ self.embed.weight.t() / math.sqrt(self.cfg.width)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ----------------------------------------------------------- shared per-token maths

    def window_qkv(self, layer: EncoderLayer, x: torch.Tensor, pos: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, width) normed, pos (T,) or (B, T) -> q (B, H, T, Dh), k and v (B, Hkv, T,
        Dh), rotary applied."""
        cfg = self.cfg
        q = layer.wq(x).unflatten(-1, (cfg.heads, cfg.head_dim)).transpose(1, 2)
        kv = layer.wkv(x).unflatten(-1, (2, cfg.kv_heads, cfg.head_dim))
        k, v = kv[..., 0, :, :].transpose(1, 2), kv[..., 1, :, :].transpose(1, 2)
        return rotary(q, pos, cfg.rope_base), rotary(k, pos, cfg.rope_base), v

    def compressed_q(self, layer: EncoderLayer | DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, width) -> q (B, H, T, Dc)."""
        return layer.wqc(x).unflatten(-1, (self.cfg.heads, self.cfg.latent_dim)).transpose(1, 2)

    def merge_out(self, layer: EncoderLayer | DecoderLayer, out_c: torch.Tensor,
                  out_w: torch.Tensor | None = None) -> torch.Tensor:
        """Already-weighted path outputs (B, H, T, D*) -> residual update (B, T, width)."""
        y = layer.woc(out_c.transpose(1, 2).flatten(2))
        if out_w is not None:
            y = y + layer.wo(out_w.transpose(1, 2).flatten(2))
        return y

    def window_scale(self) -> float:
        return self.cfg.head_dim ** -0.5

    def compressed_scale(self) -> float:
        return self.cfg.latent_dim ** -0.5
