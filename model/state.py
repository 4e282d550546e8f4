"""Per-session cache state of the bundled model (one sequence), in the layouts the store keeps.

Persistent part (global KV; kvstore writes it to every tier), E = n_tokens // m entries:
  enc.latent      codes (F, E, Dc/2) uint8, scales (F, E, Dc/g) fp16   F = full encoder layers
  enc.index_keys  codes (F, E, Di/2) uint8, scales (F, E, Di/g) fp16
  dec.latent      codes (1, E, Dc/2) uint8, scales (1, E, Dc/g) fp16
Ephemeral part (kept only in hbm/host; rebuilt by replay), S = window tokens held (<= W):
  enc.window.k    codes (L, S, Hkv, Dh) int8, scales (L, S, Hkv, Dh/gw) fp16   L = encoder layers
  enc.window.v    same
  enc.tail        (F, n_tokens % m, width) bf16, None   normed inputs of the full layers
  dec.tail        (1, n_tokens % m, width) bf16, None   normed encoder outputs
The window holds the positions n_tokens - S .. n_tokens - 1. The tails are the rows of the
not-yet-complete block; they become one entry per stream when its m-th token arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from model.config import ModelConfig

QTensor = tuple[torch.Tensor, torch.Tensor]  # (codes, fp16 scales)
PERSISTENT = ("enc.latent", "enc.index_keys", "dec.latent")
EPHEMERAL = ("enc.window.k", "enc.window.v", "enc.tail", "dec.tail")


@dataclass
class KVState:
    cfg: ModelConfig
    token_ids: torch.Tensor  # (n,) int64
    enc_latent: QTensor
    enc_index_keys: QTensor
    dec_latent: QTensor
    window_k: QTensor | None = None  # None: evicted, run model.infer.replay first
    window_v: QTensor | None = None
    enc_tail: torch.Tensor | None = None
    dec_tail: torch.Tensor | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, device: torch.device | str = "cpu") -> KVState:
        f = len(cfg.full_layers)
        ids = torch.zeros(0, dtype=torch.int64, device=device)
        enc_latent, enc_index_keys, dec_latent = (_empty_q(cfg, n, device) for n in PERSISTENT)
        st = cls(cfg, ids, enc_latent, enc_index_keys, dec_latent)
        st.window_k, st.window_v = (_empty_q(cfg, n, device) for n in EPHEMERAL[:2])
        st.enc_tail = torch.zeros(f, 0, cfg.width, dtype=torch.bfloat16, device=device)
        st.dec_tail = torch.zeros(1, 0, cfg.width, dtype=torch.bfloat16, device=device)
        return st

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def n_entries(self) -> int:
        return self.n_tokens // self.cfg.block

    @property
    def has_window(self) -> bool:
        return self.window_k is not None

    @property
    def window_len(self) -> int:
        return 0 if self.window_k is None else int(self.window_k[0].shape[1])

    def persistent_tensors(self) -> dict[str, QTensor]:
        return dict(zip(PERSISTENT, (self.enc_latent, self.enc_index_keys, self.dec_latent),
                        strict=True))

    def ephemeral_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Window K/V as (codes, scales) and the tails as (bf16 rows, None); {} if evicted."""
        if self.window_k is None or self.window_v is None:
            return {}
        parts: list[tuple[torch.Tensor, torch.Tensor | None]] = [
            self.window_k, self.window_v]
        for tail in (self.enc_tail, self.dec_tail):
            assert tail is not None  # held with the window
            parts.append((tail, None))
        return dict(zip(EPHEMERAL, parts, strict=True))

    def without_window(self) -> KVState:
        """What a tier without window KV restores: the same state minus the ephemeral part."""
        return replace(self, window_k=None, window_v=None, enc_tail=None, dec_tail=None)

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, token_ids: torch.Tensor,
                     persistent: dict[str, QTensor],
                     ephemeral: dict[str, tuple] | None = None) -> KVState:
        """Rebuild a state from the dicts persistent_tensors()/ephemeral_tensors() gave.

        Shapes and dtypes are checked against the config and the token count; a mismatch
        raises ValueError naming the stream."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        missing = set(PERSISTENT) - set(persistent)
        if missing:
            raise ValueError(f"persistent tensors missing streams {sorted(missing)}")
        enc_latent, enc_index_keys, dec_latent = (persistent[n] for n in PERSISTENT)
        st = cls(cfg, ids, enc_latent, enc_index_keys, dec_latent)
        if ephemeral:
            missing = set(EPHEMERAL) - set(ephemeral)
            if missing:
                raise ValueError(f"ephemeral tensors missing streams {sorted(missing)}")
            st.window_k, st.window_v = ephemeral["enc.window.k"], ephemeral["enc.window.v"]
            st.enc_tail, st.dec_tail = ephemeral["enc.tail"][0], ephemeral["dec.tail"][0]
        st.validate()
        return st

    def validate(self) -> None:
        """Raise ValueError unless every tensor has the layout stated in the module doc."""
        cfg, e = self.cfg, self.n_entries
        if self.token_ids.dim() != 1 or self.token_ids.dtype != torch.int64:
            raise ValueError("token_ids must be a 1-D int64 tensor")
        for name, q in self.persistent_tensors().items():
            _check_q(name, q, _q_shape(cfg, name, e))
        if not self.has_window:
            return
        s = self.window_len
        if s > min(cfg.window, self.n_tokens):
            raise ValueError(f"window holds {s} tokens, more than min(W, n_tokens)")
        for name in EPHEMERAL[:2]:
            _check_q(name, self.ephemeral_tensors()[name], _q_shape(cfg, name, s))
        tail = self.n_tokens % cfg.block
        for name, t, layers in (("enc.tail", self.enc_tail, len(cfg.full_layers)),
                                ("dec.tail", self.dec_tail, 1)):
            want = (layers, tail, cfg.width)
            if t is None or tuple(t.shape) != want or t.dtype != torch.bfloat16:
                got = None if t is None else (tuple(t.shape), t.dtype)
                raise ValueError(f"{name} must be {want} bfloat16, got {got}")


def _q_shape(cfg: ModelConfig, name: str, length: int) -> tuple[tuple, tuple, torch.dtype]:
    """(codes shape, scales shape, codes dtype) of a quantized stream holding `length` rows."""
    f = len(cfg.full_layers)
    if name in ("enc.latent", "dec.latent"):
        layers = f if name == "enc.latent" else 1
        d, g = cfg.latent_dim, cfg.group_size
        return (layers, length, d // 2), (layers, length, d // g), torch.uint8
    if name == "enc.index_keys":
        d, g = cfg.index_dim, cfg.group_size
        return (f, length, d // 2), (f, length, d // g), torch.uint8
    lead = (len(cfg.enc_modes), length, cfg.kv_heads)
    return ((*lead, cfg.head_dim), (*lead, cfg.head_dim // cfg.window_group_size),
            torch.int8)


def _empty_q(cfg: ModelConfig, name: str, device) -> QTensor:
    codes, scales, dtype = _q_shape(cfg, name, 0)
    return (torch.zeros(codes, dtype=dtype, device=device),
            torch.zeros(scales, dtype=torch.float16, device=device))


def _check_q(name: str, q, want: tuple[tuple, tuple, torch.dtype]) -> None:
    codes_shape, scales_shape, dtype = want
    if not isinstance(q, tuple) or len(q) != 2:
        raise ValueError(f"{name} must be a (codes, scales) pair")
    codes, scales = q
    if tuple(codes.shape) != codes_shape or codes.dtype != dtype:
        raise ValueError(f"{name} codes must be {codes_shape} {dtype}, "
                         f"got {tuple(codes.shape)} {codes.dtype}")
    if tuple(scales.shape) != scales_shape or scales.dtype != torch.float16:
        raise ValueError(f"{name} scales must be {scales_shape} float16, "
                         f"got {tuple(scales.shape)} {scales.dtype}")
