"""Training attention: whole sequences at once, in float, with straight-through fake
quantization that rounds exactly as the stored int8/int4 caches do.

`TrainingAttention` is the backend KVTierLM.forward runs with in training (and in
model.eval's indexer figures); model/cache.py's `CachedAttention` is the inference one.
Both compute the same function: same layers, same quantizers (kernels.ops), same
visibility rules, same selection rules, top-k ties to the lower entry id in both.

Also returns the indexer's auxiliary loss: each indexer is distilled toward the dense
attention (over every visible compressed entry) of the layers that use its selection.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.nn import functional as F

from kernels import ops
from model.config import ModelConfig
from model.net import Compressor, DecoderLayer, EncoderLayer, KVTierLM


def fake_int8(x: torch.Tensor, group_size: int) -> torch.Tensor:
    codes, scales = ops.quantize_int8(x.detach(), group_size)
    return x + (ops.dequantize_int8(codes, scales, group_size) - x).detach()


def fake_int4(x: torch.Tensor, group_size: int) -> torch.Tensor:
    packed, scales = ops.quantize_int4(x.detach(), group_size)
    return x + (ops.dequantize_int4(packed, scales, group_size) - x).detach()


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores (B, T, N) -> bool (B, T, N): the k best finite entries per row, ties to the
    lower index as kernels.ops.indexer_topk breaks them (ReLU scores tie at 0 often)."""
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :k], idx[..., :k]
    return torch.zeros_like(scores, dtype=torch.bool).scatter(-1, idx, vals > float("-inf"))


def leaky_relu_grad(x: torch.Tensor, leak: float) -> torch.Tensor:
    """relu(x) exactly in the forward pass, with slope `leak` instead of 0 below zero in
    the backward pass. With a plain ReLU an indexer whose every q.k went negative gets no
    gradient again and selects by the tie rule (the oldest entries) for good: in the
    first shipped model, 96-100 % of the rows of three of its five indexers were all 0."""
    if not leak:
        return torch.relu(x)
    below = (x < 0).to(x.dtype)
    return torch.relu(x) + leak * below * (x - x.detach())


def index_scores(qi: torch.Tensor, ki: torch.Tensor, w: torch.Tensor,
                 visible: torch.Tensor, leak: float = 0.0) -> torch.Tensor:
    """qi (B, T, Hi, Di), ki (B, N, Di), w (B, T, Hi), visible (T, N) -> (B, T, N)."""
    dots = leaky_relu_grad(torch.einsum("bthd,bnd->bthn", qi, ki), leak)
    scores = torch.einsum("bthn,bth->btn", dots, w)
    return scores.masked_fill(~visible, float("-inf"))


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; rows with nothing visible become all zeros (not NaN).

    A finite fill keeps the backward pass free of NaN on empty rows (exp(-inf + inf))."""
    return torch.softmax(logits.masked_fill(~mask, -1e30), -1) * mask


def window_mask(window: int, device: torch.device) -> torch.Tensor:
    """(W, 2W) bool: query i of a block sees key j of [previous block, this block] iff
    0 <= (W + i) - j < W."""
    i = torch.arange(window, device=device).view(window, 1)
    j = torch.arange(2 * window, device=device).view(1, 2 * window)
    delta = window + i - j
    return (delta >= 0) & (delta < window)


def joint_attention(w: int, sm_scale: float, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, clog: torch.Tensor, cmask: torch.Tensor,
                    latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax per head over window keys (the last w) and compressed entries.

    q (B, H, T, Dh); k, v (B, Hkv, T, Dh); clog (B, H, T, N) compressed logits; cmask
    (B, 1, T, N) bool; latent (B, N, Dc). Returns weighted outputs out_w (B, H, T, Dh) and
    out_c (B, H, T, Dc), whose projections sum to the layer's attention output.
    """
    b, h, t, dh = q.shape
    nb, n = t // w, clog.shape[-1]
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    # keys for query block j: blocks j-1 and j (block -1 is zero padding, masked out)
    pad = q.new_zeros(b, h, 1, w, dh)
    kb, vb = k.view(b, h, nb, w, dh), v.view(b, h, nb, w, dh)
    kk = torch.cat((torch.cat((pad, kb[:, :, :-1]), 2), kb), 3)  # (B, H, nb, 2W, Dh)
    vv = torch.cat((torch.cat((pad, vb[:, :, :-1]), 2), vb), 3)
    wlog = q.view(b, h, nb, w, dh) @ kk.transpose(-1, -2) * sm_scale
    wmask = window_mask(w, q.device).expand(nb, w, 2 * w).clone()
    wmask[0, :, :w] = False
    logits = torch.cat((wlog.masked_fill(~wmask, float("-inf")),
                        clog.view(b, h, nb, w, n).masked_fill(
                            ~cmask.view(b, 1, nb, w, n), float("-inf"))), -1)
    # every query sees itself, so no row is empty; split, not slicing: slices' backward
    # zero-fills a whole copy of p each (a third of the step's non-matmul time, measured)
    p_w, p_c = torch.softmax(logits, -1).split((2 * w, n), -1)
    out_w = (p_w @ vv).view(b, h, t, dh)
    out_c = p_c.reshape(b, h, t, n) @ latent.unsqueeze(1)
    return out_w, out_c


def in_float32(method):
    """Run a backend method's maths (quantizers, indexer, attention) in float32 with
    autocast off, whatever dtype the linear layers feeding it ran in: a bf16 softmax or
    quantizer input would round far more coarsely than the cache does."""
    @functools.wraps(method)
    def run(self, first, *tensors: torch.Tensor):
        with torch.autocast(self.device.type, enabled=False):
            return method(self, first, *(t.float() for t in tensors))
    return run


class TrainingAttention:
    """The backend for whole sequences ids (B, T): every key of the sequence is at hand, in
    float, rounded by the cache's quantizers. N = T // m entries; visible (T, N) says
    which entries each query may see (its block complete)."""

    def __init__(self, cfg: ModelConfig, b: int, t: int, device: torch.device, sparse: bool,
                 index_leak: float = 0.0):
        self.cfg, self.b, self.t, self.sparse, self.device = cfg, b, t, sparse, device
        self.index_leak = index_leak  # see leaky_relu_grad
        self.n = t // cfg.block
        self.pos = torch.arange(t, device=device)  # (T,)
        self.visible = (torch.arange(self.n, device=device).view(1, self.n)
                        < ((self.pos + 1) // cfg.block).view(t, 1))  # (T, N)
        self.groups: list[dict] = []  # per indexer: its scores, the attention it should predict
        # each set by the step of the layer pass that makes it, before it is read
        self.k: torch.Tensor  # (B, Hkv, T, Dh) fake-int8, of the layer being run
        self.v: torch.Tensor
        self.latent: torch.Tensor  # (B, N, Dc) fake-int4, of the last full layer
        self.keys: torch.Tensor  # (B, N, Di) fake-int4
        self.pool: torch.Tensor  # (B, T, N) bool
        self.sel: torch.Tensor
        self.dec_latent: torch.Tensor  # (B, N, Dc) fake-int4

    @in_float32
    def store_window(self, layer: EncoderLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        g = self.cfg.window_group_size
        self.k, self.v = fake_int8(k, g), fake_int8(v, g)

    @in_float32
    def add_entries(self, layer: EncoderLayer, x: torch.Tensor) -> None:
        blocks = x.reshape(self.b, self.n, self.cfg.block * self.cfg.width)
        self.latent = fake_int4(layer.latent(blocks), self.cfg.group_size)
        self.keys = fake_int4(layer.index_key(blocks), self.cfg.group_size)

    @in_float32
    def select(self, layer: EncoderLayer | DecoderLayer, x: torch.Tensor) -> None:
        cfg = self.cfg
        qi, wts = layer.indexer(x)
        scores = index_scores(qi, self.keys, wts, self.visible, self.index_leak)
        if layer.mode == "full":
            self.sel, self.pool = topk_mask(scores, cfg.topk), topk_mask(scores, cfg.pool)
        else:
            self.sel = topk_mask(scores.masked_fill(~self.pool, float("-inf")), cfg.topk)
        # the candidates its top-k chooses among: every visible entry, or (reindex) the pool
        self.groups.append({"scores": scores, "targets": [], "sel": self.sel,
                            "candidates": None if layer.mode == "full" else self.pool})

    def _compressed_logits(self, layer: EncoderLayer | DecoderLayer, qc: torch.Tensor,
                           latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qc (B, H, T, Dc), latent (B, N, Dc) -> logits (B, H, T, N) and the mask (B, 1, T,
        N) of the entries attended; records the dense attention the indexer should predict."""
        t, n = self.t, self.n
        clog = qc @ latent.unsqueeze(1).transpose(-1, -2)
        clog = clog * layer.compressed_scale
        probs = masked_softmax(clog.detach(), self.visible.view(1, 1, t, n))
        self.groups[-1]["targets"].append(probs.mean(1))
        cmask = (self.sel if self.sparse else self.visible.expand(self.b, t, n)).unsqueeze(1)
        return clog, cmask

    @in_float32
    def encoder_attention(self, layer: EncoderLayer, q: torch.Tensor, qc: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        clog, cmask = self._compressed_logits(layer, qc, self.latent)
        return joint_attention(self.cfg.window, layer.window_scale, q, self.k, self.v, clog,
                               cmask, self.latent)

    @in_float32
    def global_kv(self, compressor: Compressor, normed: torch.Tensor) -> None:
        blocks = normed.reshape(self.b, self.n, self.cfg.block * self.cfg.width)
        self.dec_latent = fake_int4(compressor(blocks), self.cfg.group_size)

    def decoder_rows(self, h: torch.Tensor) -> torch.Tensor:
        return h  # training predicts every position

    @in_float32
    def decoder_attention(self, layer: DecoderLayer, qc: torch.Tensor) -> torch.Tensor:
        clog, cmask = self._compressed_logits(layer, qc, self.dec_latent)
        return masked_softmax(clog, cmask) @ self.dec_latent.unsqueeze(1)


def forward_train(model: KVTierLM, ids: torch.Tensor, sparse: bool = True,
                  stats: list | None = None, linear_dtype: torch.dtype = torch.float32,
                  index_leak: float = 0.0, target_power: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, T) int64, T a multiple of the window and of m -> (logits (B, T, vocab)
    float32, aux).

    sparse=False attends to every visible compressed entry (warm-up while the indexers
    learn); sparse=True attends only to each layer's top-k selection, as inference does.
    stats, if given, receives one selection_quality() dict per indexer. linear_dtype
    bfloat16 runs the model's linear layers under autocast (float32 master weights; the
    backend's maths stays float32), much faster on a CPU with bf16 matmuls.
    index_leak: the indexers' ReLU gradient below zero (leaky_relu_grad); the forward
    values, selections included, do not depend on it. target_power: see indexer_loss.
    """
    cfg = model.cfg
    b, t = ids.shape
    if t % cfg.window or t % cfg.block:
        raise ValueError(f"sequence length {t} must be a multiple of window and block")
    attn = TrainingAttention(cfg, b, t, ids.device, sparse, index_leak)
    cast = (contextlib.nullcontext() if linear_dtype == torch.float32 else
            torch.autocast(ids.device.type, dtype=linear_dtype))
    with cast:
        logits = model(ids, attn).float()
    if stats is not None:
        stats.extend(selection_quality(g, attn.visible, cfg.topk) for g in attn.groups)
    return logits, indexer_loss(attn.groups, attn.visible, target_power)


@torch.no_grad()
def selection_quality(group: dict, visible: torch.Tensor, k: int) -> dict:
    """How much of the dense attention mass (the indexer's target) its top-k selection
    holds, against what k random visible entries would hold, over queries seeing > k;
    and the most any top-k of its candidates could hold (`best`: a reindexing layer
    chooses inside the pool only, so its ceiling can sit below its target's own top-k)."""
    rows = visible.sum(-1) > k
    target = torch.stack(group["targets"]).mean(0)[:, rows]
    captured = (target * group["sel"][:, rows]).sum(-1).mean().item()
    random = (k / visible[rows].sum(-1).float()).mean().item()
    candidates = visible[rows] if group["candidates"] is None else group["candidates"][:, rows]
    best = (target * topk_mask(target.masked_fill(~candidates, float("-inf")), k))
    return {"captured": captured, "random": random, "best": best.sum(-1).mean().item()}


def indexer_loss(groups: list[dict], visible: torch.Tensor, power: float = 1.0) -> torch.Tensor:
    """Mean cross-entropy of each indexer's distribution against the head- and layer-averaged
    dense attention of the layers that use its selection (queries with entries only),
    raised to `power` and renormalized. Early in training that attention is close to
    uniform, and all-zero scores (a dead ReLU) fit a near-uniform target almost as well
    as any; power > 1 sharpens it toward the entries a top-k should hold."""
    rows = visible.any(-1)  # (T,): empty rows would put NaN into the backward pass
    vis = visible[rows]
    total: torch.Tensor | float = 0.0
    for g in groups:
        target = torch.stack(g["targets"]).mean(0)[:, rows]  # (B, T', N)
        if power != 1.0:
            target = target.pow(power)
            target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
        logp = F.log_softmax(g["scores"][:, rows], -1).masked_fill(~vis, 0.0)
        total = total - (target * logp).sum(-1).mean()
    return torch.as_tensor(total) / max(len(groups), 1)
