"""DeepseekV4's caches <-> kvtier streams, and the bounded replay that rebuilds the window.

Model side (transformers 5.23 ``modeling_deepseek_v4``), per layer of a ``DynamicCache``,
batch 1:
  every layer        keys = values (1, 1, min(n, W - 1), head_dim): the sliding window
  CSA layers         compressed_kv[name] (1, n // 4, dim); buffer_kv/buffer_gate[name]
                     (1, n % 4, 2 dim); overlap_kv/overlap_gate[name] (1, 4, dim)
                     for name "compressor" (dim = head_dim) and "indexer" (index_head_dim)
  HCA layers         compressed_kv["compressor"] (1, n // 128, head_dim);
                     buffer_kv/buffer_gate (1, n % 128, head_dim)
Store side (``hf_layouts.deepseek_v4_layout``): ``csa.kv``/``csa.index``/``hca.kv``
(layers, entries, dim) quantized; ``window`` (layers, rows, head_dim); buffers
(layers, rows, 2, dim): row t holds (kv, gate) of one token; overlaps the same over m rows.

Replay (``replay_window``): the persisted entries already hold every complete window of
the n tokens, so the compressors must not emit any of them again. The replay runs the
last tokens through the model itself with its CSA/HCA cache layers swapped for
``_Frozen*`` twins whose ``store_compression_weights`` returns no window to compress: a
token before its compressor's unfinished block is dropped (its entry is persisted), a
token of the last complete CSA window leaves its Ca half (gate + position bias) as the
overlap state, a token of the unfinished block joins the buffer (fewer than m: it never
closes a window). Each replayed query still sees exactly the entries it saw in the
never-evicted run: the compressor and indexer masks keep entry w for query t only when
w < (t + 1) // m, and the replay passes the true positions. So the replay must start at
or before (a) n - (W - 1), to refill the window, (b) the first token of each compressor's
unfinished block, and (c) the first token of the last complete CSA window: R is raised to
that aligned start (``replay_start``). What it recomputes from a truncated window (the
first replayed tokens see nothing before the start) is the accepted approximation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4CSACache,
    DeepseekV4HCACache,
)

from kvstore.format.chunk import StreamData
from kvstore.format.errors import InvalidRequest, LayoutMismatch
from kvstore.format.hf.attention import HFConfig, HFModel
from kvstore.format.hf.model_layouts import CSA, HCA
from kvstore.format.hf.quant import decode_values, encode_values
from kvstore.format.layout import LayoutSpec

NAMES = {"compressor": ("csa.kv", "csa.buffer", "csa.overlap"),
         "indexer": ("csa.index", "csa.index_buffer", "csa.index_overlap")}


def _layers(config: HFConfig, kind: str) -> list[int]:
    return [i for i, t in enumerate(config.layer_types) if t == kind]


def _cache_layers(cache: DynamicCache) -> list[Any]:
    """``cache``'s layers, DeepseekV4's CSA/HCA cache layers among them: transformers
    types them as the union of its layer mixins, which have none of their attributes."""
    return list(cache.layers)


def cache_tokens(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def persistent_streams(spec: LayoutSpec, config: HFConfig, cache: DynamicCache
                       ) -> dict[str, StreamData]:
    """The compressed entries of ``cache`` as the layout stores them (quantized)."""
    n = cache_tokens(cache)
    out = {}
    for stream_name, kind, name in (("csa.kv", CSA, "compressor"), ("csa.index", CSA, "indexer"),
                                    ("hca.kv", HCA, "compressor")):
        layers = _layers(config, kind)
        if not layers:
            continue
        stream = spec.stream(stream_name)
        rows = []
        for i in layers:
            layer = _cache_layers(cache)[i]
            entries = layer.compressed_kv[name]
            if entries is None:  # no window closed yet
                entries = torch.zeros(1, 0, stream.entry_shape[0])
            if entries.shape[0] != 1 or entries.shape[1] != stream.entries_for(n):
                raise LayoutMismatch(f"layer {i} holds {tuple(entries.shape)} {name} entries; "
                                     f"{n} tokens at m={stream.tokens_per_entry} make "
                                     f"{stream.entries_for(n)} (batch 1 only)")
            rows.append(entries[0])
        out[stream_name] = encode_values(stream, torch.stack(rows))
    return out


def window_streams(spec: LayoutSpec, config: HFConfig, cache: DynamicCache
                   ) -> dict[str, StreamData]:
    """The ephemeral part of ``cache``: window K=V and the partial-block state (bf16)."""
    out = {"window": encode_values(spec.stream("window"),
                                   torch.stack([layer.keys[0, 0]
                                                for layer in _cache_layers(cache)]))}
    for kind, names in ((CSA, NAMES), (HCA, {"compressor": ("hca.kv", "hca.buffer", None)})):
        layers = [_cache_layers(cache)[i] for i in _layers(config, kind)]
        if not layers:
            continue
        for name, (_, buffer, overlap) in names.items():
            if layers[0].buffer_kv[name] is not None and layers[0].buffer_kv[name].shape[1]:
                kv = torch.stack([layer.buffer_kv[name][0] for layer in layers])
                gate = torch.stack([layer.buffer_gate[name][0] for layer in layers])
                out[buffer] = encode_values(spec.stream(buffer), torch.stack((kv, gate), dim=2))
            if overlap and layers[0].overlap_kv[name] is not None:
                kv = torch.stack([layer.overlap_kv[name][0] for layer in layers])
                gate = torch.stack([layer.overlap_gate[name][0] for layer in layers])
                out[overlap] = encode_values(spec.stream(overlap),
                                             torch.stack((kv, gate), dim=2))
    return out


def _dtype(model: HFModel) -> torch.dtype:
    dtype: torch.dtype = model.model.embed_tokens.weight.dtype
    return dtype


def _install_window(layer: Any, rows: torch.Tensor, n: int) -> None:
    """rows (S, head_dim) as the layer's window K=V; the layer has seen n tokens."""
    kv = rows[None, None]
    layer.lazy_initialization(kv, kv)
    layer.keys = layer.values = kv
    layer.cumulative_length = n


def build_cache(spec: LayoutSpec, model: HFModel, n: int, persistent: dict[str, StreamData],
                window: dict[str, StreamData] | None,
                layer_classes: dict[str, Callable[..., Any]] | None = None) -> DynamicCache:
    """A ``DynamicCache`` of the model's own layer classes (or ``layer_classes``, kind ->
    class) holding the persisted entries, and the window and partial-block state when
    given (``window`` None: no window, the buffers empty)."""
    config = model.config
    dtype = _dtype(model)
    cache = DynamicCache(config=config)
    if layer_classes:
        cache.layers = [layer_classes[t](config, model, i) if t in layer_classes else layer
                        for i, (t, layer) in enumerate(zip(config.layer_types, cache.layers,
                                                           strict=True))]
    values = {s.name: decode_values(s, persistent[s.name]).to(dtype)
              for s in spec.persistent_streams}
    state = ({name: decode_values(spec.stream(name), data).to(dtype)
              for name, data in window.items()} if window is not None else {})
    for kind, names in ((CSA, NAMES), (HCA, {"compressor": ("hca.kv", "hca.buffer", None)})):
        for j, i in enumerate(_layers(config, kind)):
            layer = _cache_layers(cache)[i]
            for name, (entries, buffer, overlap) in names.items():
                layer.compressed_kv[name] = values[entries][j][None]
                layer.entry_count[name] = values[entries].shape[1]
                if window is None:
                    continue
                rows = state.get(buffer)
                width = spec.stream(buffer).entry_shape[1]
                rows = rows[j] if rows is not None else torch.zeros(0, 2, width, dtype=dtype)
                layer.buffer_kv[name], layer.buffer_gate[name] = rows[None, :, 0], rows[None, :, 1]
                if overlap and overlap in state:
                    layer.overlap_kv[name] = state[overlap][j][None, :, 0]
                    layer.overlap_gate[name] = state[overlap][j][None, :, 1]
    if window is not None:
        for i, layer in enumerate(_cache_layers(cache)):
            _install_window(layer, state["window"][i], n)
    return cache


def replay_start(config: HFConfig, n: int, r: int) -> int:
    """The first replayed token for a requested R: at most n - R, and early enough for
    the window and every compressor's partial-block state (module docstring)."""
    window: int = config.sliding_window - 1
    start = n - max(r, window)
    for kind in (CSA, HCA):
        if _layers(config, kind):
            m = config.compress_rates[kind]
            boundary = n // m * m
            start = min(start, boundary - m if kind == CSA and boundary >= m else boundary)
    return max(start, 0)


class _Freeze:
    """Mixed into the cache layers for the replay: no window is compressed again."""

    # the cache layer's, declared for the methods here
    compress_rate: int
    entry_count: dict[str, int]
    buffer_kv: dict[str, torch.Tensor | None]
    buffer_gate: dict[str, torch.Tensor | None]
    overlap_kv: dict[str, torch.Tensor | None]
    overlap_gate: dict[str, torch.Tensor | None]

    def _frozen_init(self, model: HFModel, layer_idx: int, names: tuple[str, ...]) -> None:
        compressor = model.model.layers[layer_idx].self_attn.compressor
        modules = {"compressor": compressor, "indexer": getattr(compressor, "indexer", None)}
        self.position_bias = {name: modules[name].position_bias for name in names}
        self.position = dict.fromkeys(names, 0)  # the next token's position, per name

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
        m = self.compress_rate
        start = self.position[name]
        self.position[name] += kv.shape[1]
        boundary = self.entry_count[name] * m  # every window before it is persisted
        cut = min(max(boundary - start, 0), kv.shape[1])
        if cut < kv.shape[1]:  # the unfinished block: the buffer
            old_kv, old_gate = self.buffer_kv[name], self.buffer_gate[name]
            new_kv, new_gate = kv[:, cut:], gate[:, cut:]
            self.buffer_kv[name] = new_kv if old_kv is None else torch.cat([old_kv, new_kv], 1)
            self.buffer_gate[name] = (new_gate if old_gate is None
                                      else torch.cat([old_gate, new_gate], 1))
        if hasattr(self, "overlap_kv") and boundary >= m:  # the last complete window's Ca
            a, b = max(boundary - m - start, 0), min(max(boundary - start, 0), kv.shape[1])
            if a < b:
                d = kv.shape[-1] // 2
                rows = torch.arange(start + a, start + b) - (boundary - m)
                ca_kv = kv[:, a:b, :d]
                ca_gate = gate[:, a:b, :d] + self.position_bias[name][rows, :d].to(gate.dtype)
                old_kv, old_gate = self.overlap_kv[name], self.overlap_gate[name]
                self.overlap_kv[name] = ca_kv if old_kv is None else torch.cat([old_kv, ca_kv], 1)
                self.overlap_gate[name] = (ca_gate if old_gate is None
                                           else torch.cat([old_gate, ca_gate], 1))
        return kv[:, :0], gate[:, :0], boundary


class _FrozenCSA(_Freeze, DeepseekV4CSACache):  # type: ignore[no-untyped-call]  # its class hook is untyped
    # None: unregistered, so DynamicCache(config) keeps building the model's own
    # (transformers types the attribute str)
    _layer_type = None  # type: ignore[assignment]

    def __init__(self, config: HFConfig, model: HFModel, layer_idx: int) -> None:
        DeepseekV4CSACache.__init__(self, config)
        self._frozen_init(model, layer_idx, ("compressor", "indexer"))


class _FrozenHCA(_Freeze, DeepseekV4HCACache):  # type: ignore[no-untyped-call]  # likewise
    _layer_type = None  # type: ignore[assignment]  # unregistered too

    def __init__(self, config: HFConfig, model: HFModel, layer_idx: int) -> None:
        DeepseekV4HCACache.__init__(self, config)
        self._frozen_init(model, layer_idx, ("compressor",))


@torch.no_grad()
def replay_window(spec: LayoutSpec, model: HFModel, token_ids: torch.Tensor,
                  persistent: dict[str, StreamData], r: int
                  ) -> tuple[dict[str, StreamData], int]:
    """Rebuild the window and partial-block state of a session of ``token_ids`` (n,) from
    its persisted entries by rerunning its last tokens (at least ``r``, aligned by
    ``replay_start``) through ``model``: (window streams, tokens replayed)."""
    config = model.config
    n = len(token_ids)
    if n == 0:
        raise InvalidRequest("a session without tokens has no window to rebuild")
    start = replay_start(config, n, r)
    cache = build_cache(spec, model, n, persistent, None, {CSA: _FrozenCSA, HCA: _FrozenHCA})
    for layer in _cache_layers(cache):
        if isinstance(layer, _Freeze):
            layer.position = dict.fromkeys(layer.position, start)
    # cumulative_length 0 with the true positions: the masks are relative, RoPE and the
    # compressors' causality use position_ids
    ids = token_ids[start:].to(torch.long)[None]
    model(input_ids=ids, position_ids=torch.arange(start, n)[None], past_key_values=cache,
          use_cache=True)
    for layer in _cache_layers(cache):
        layer.cumulative_length = n
    return window_streams(spec, config, cache), n - start
