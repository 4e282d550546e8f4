"""Spill and resume a Hugging Face transformers cache through kvtier.

    from kvtier.integrations.transformers import spill_cache, resume_cache
    out = model.generate(ids, max_new_tokens=32, return_dict_in_generate=True)
    tokens = out.sequences[0, :-1]            # what the cache covers (the last token is not in it)
    spill_cache(client, "acme", "s1", model, out.past_key_values, tokens, generation=1)
    cache, tokens = resume_cache(client, "acme", "s1", model)
    model.generate(torch.cat([tokens, last])[None], past_key_values=cache, ...)

The layout comes from ``model.config`` (``kvstore.format.hf.model_layouts``): spill_cache
registers it with the server when the server does not know it (``UnknownLayout``) and
retries once. Standard models (a ``DynamicCache`` of full-attention and sliding-window
layers, the classes transformers builds for the config) keep every layer persistent, at
16 bits in the model's own float (bf16 or fp16, lossless; ``bits=16``, the default; a
float32 model's at bf16) or quantized (``bits=8``: int8; ``format="fp8_e4m3"``: fp8 with
one scale per layer per chunk); a 16-bit ``format`` other than a bf16 / fp16 model's own
is refused, never a silent rounding. Nothing to replay: a sliding layer comes back with
its last W - 1 rows and its count of every token seen. Any other model
(other layer kinds, encoder-decoder, per-layer head shapes) is ``UnsupportedModel``,
raised before anything is sent. DeepseekV4 keeps its compressor and indexer entries at 4
or 8 bits and drops the window and the partial-block state; resume_cache has them
rebuilt by bounded replay (``kvstore.format.hf.deepseek_v4``): by the server's replay worker
(``replay="server"``), by this process's model (``"local"``), or the server's when it has
one (``"auto"``).

Model identity: both state the model's fingerprint computed from its weights, buffers
and config (``model_fingerprint(model)``, ``kvstore.format.model_identity``: the same
weights with another ``rope_theta`` are another model) unless given one
(``model_fingerprint=``; "" states none), so a session resumes only into the model
that spilled it (``ModelMismatch`` otherwise) and the server's replayer rebuilds its
window only with that model. Hashing reads every weight once per call: a caller that
spills often can compute it once and pass it.

``async_spill_cache`` / ``async_resume_cache`` take a ``kvtier.AsyncClient``; the model's
tensor work runs in a thread. Batch size 1 only.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from kvstore.format.chunk import StreamData
from kvstore.format.errors import (
    InvalidRequest,
    LayoutMismatch,
    PreconditionFailed,
    UnknownLayout,
    UnsupportedModel,
)
from kvstore.format.hf import deepseek_v4
from kvstore.format.hf.attention import HFModel, layer_windows, text_config
from kvstore.format.hf.model_layouts import candidate_layouts, is_deepseek_v4, layout_for
from kvstore.format.hf.quant import decode_values, encode_values
from kvstore.format.layout import LayoutSpec
from kvstore.format.model_identity import module_fingerprint
from kvtier.client import AsyncClient
from kvtier.sync import Client
from kvtier.types import RestoredSession, SpillResult, TokenIds

REPLAY_MODES = ("auto", "server", "local")


def _dynamic(cache: DynamicCache) -> list[Any]:
    """``cache``'s layers: transformers types them as the union of its layer mixins, and a
    model this integration takes has dynamic (or sliding) layers, with keys and values."""
    return list(cache.layers)


def model_layout(model: HFModel, bits: int | None = None, *, format: str | None = None
                 ) -> LayoutSpec:
    """The layout of ``model``'s cache at ``bits`` or in ``format``, for the model's dtype
    (``model_layouts.layout_for``). It is not registered in this process: a spill names
    the spec itself, and a restore resolves the session's layout id from the server's
    list (``AsyncClient.layout``)."""
    return layout_for(model.config, bits, format=format, dtype=getattr(model, "dtype", None))


def model_fingerprint(model: HFModel) -> str:
    """The fingerprint of ``model``: its weights and buffers (rotary tables included), in
    their dtype, and the config fields that enter its KV (``model_identity``)."""
    return module_fingerprint(model, model.config)


async def _fingerprint(model: HFModel, given: str | None) -> str:
    return await asyncio.to_thread(model_fingerprint, model) if given is None else given


def _token_array(token_ids: TokenIds) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().reshape(-1).numpy()
    return np.asarray(token_ids, dtype=np.int64).reshape(-1)


def cache_streams(spec: LayoutSpec, model: HFModel, cache: DynamicCache, num_tokens: int
                  ) -> dict[str, StreamData]:
    """The persistent streams of ``cache`` (which must cover ``num_tokens`` tokens)."""
    if not isinstance(cache, DynamicCache):
        raise InvalidRequest(f"expected a transformers DynamicCache, got {type(cache).__name__}")
    held = cache.get_seq_length()
    if held != num_tokens:
        raise InvalidRequest(f"the cache covers {held} tokens and {num_tokens} token ids were "
                             "given (after generate, the last token is not in the cache)")
    if is_deepseek_v4(model.config):
        return deepseek_v4.persistent_streams(spec, model.config, cache)
    windows = layer_windows(model.config)
    _check_layers(cache, windows, num_tokens)
    heads, head_dim = spec.stream("k").entry_shape
    out = {}
    for name in ("k", "v"):
        tensors = [layer.keys if name == "k" else layer.values for layer in _dynamic(cache)]
        for i, t in enumerate(tensors):
            if (t.shape[1], t.shape[3]) != (heads, head_dim):
                raise UnsupportedModel(
                    f"{text_config(model.config).model_type}: layer {i} holds {name} of shape "
                    f"{tuple(t.shape)}, the config gives (1, {heads}, tokens, {head_dim}) "
                    "(per-layer head shapes are not supported)")
        # (1, heads, rows, head_dim) per layer -> (layers, tokens, heads, head_dim); a
        # sliding layer's rows are its last ones, the tokens before them zeros
        values = tensors[0].new_zeros(len(tensors), num_tokens, heads, head_dim)
        for i, (t, window) in enumerate(zip(tensors, windows, strict=True)):
            rows = _rows_kept(window, num_tokens)
            if rows:
                values[i, num_tokens - rows:] = t[0, :, t.shape[2] - rows:].transpose(0, 1)
        out[name] = encode_values(spec.stream(name), values)
    return out


def _rows_kept(window: int, num_tokens: int) -> int:
    """Rows a layer of ``window`` (0: full attention) holds after ``num_tokens`` tokens."""
    return num_tokens if window == 0 else min(num_tokens, window - 1)


def _check_layers(cache: DynamicCache, windows: tuple[int, ...], n: int) -> None:
    """``cache`` has the layers transformers builds for the model (``windows``), batch 1,
    every layer holding what its kind keeps after ``n`` tokens."""
    if len(cache.layers) != len(windows):
        raise LayoutMismatch(f"the cache has {len(cache.layers)} layers, the model "
                             f"{len(windows)}")
    for i, (layer, window) in enumerate(zip(cache.layers, windows, strict=True)):
        want = DynamicSlidingWindowLayer if window else DynamicLayer
        if type(layer) is not want or getattr(layer, "sliding_window", 0) != window:
            raise InvalidRequest(
                f"layer {i} is a {type(layer).__name__}; transformers builds a {want.__name__}"
                + (f" (sliding window {window})" if window else "") + " for this model: spill "
                "the cache the model made (DynamicCache(config=model.config), as generate does)")
        if layer.keys is None or layer.values is None or layer.keys.dim() != 4:
            raise InvalidRequest(f"layer {i} holds no keys: only caches with every layer "
                                 "filled can be spilled")
        if layer.keys.shape[0] != 1 or layer.values.shape[0] != 1:
            raise InvalidRequest("only batch-1 caches can be spilled, got batch "
                                 f"{layer.keys.shape[0]}")
        rows = layer.keys.shape[2]
        if layer.get_seq_length() != n or rows < _rows_kept(window, n) or rows > n \
                or layer.values.shape[2] != rows:
            raise InvalidRequest(f"layer {i} holds {rows} rows of {layer.get_seq_length()} "
                                 f"tokens; {n} tokens were given")


def standard_cache(spec: LayoutSpec, model: HFModel, persistent: dict[str, StreamData]
                   ) -> DynamicCache:
    """A ``DynamicCache`` of the model's layers (its own classes) from the k/v streams."""
    dtype = model.get_input_embeddings().weight.dtype
    k, v = (decode_values(spec.stream(name), persistent[name], spec.chunk_tokens).to(dtype)
            for name in ("k", "v"))
    windows = layer_windows(model.config)
    cache = DynamicCache(config=model.config)
    n = k.shape[1]
    for layer, window, keys, values in zip(_dynamic(cache), windows, k, v, strict=True):
        rows = _rows_kept(window, n)
        # (tokens, heads, head_dim) -> (1, heads, rows, head_dim): the rows the layer keeps
        keys, values = (x[n - rows:].transpose(0, 1)[None].contiguous() for x in (keys, values))
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if window:
            layer.cumulative_length = n  # every token seen, the last W - 1 kept
    return cache


async def async_spill_cache(client: AsyncClient, tenant: str, session_id: str, model: HFModel,
                            cache: DynamicCache, token_ids: TokenIds, *, generation: int,
                            ack: str | None = None, bits: int | None = None,
                            format: str | None = None, **spill_options: Any) -> SpillResult:
    """Spill ``cache`` (covering ``token_ids``) as generation ``generation`` through a
    ``kvtier.AsyncClient``; ``bits`` or ``format`` picks the layout's precision
    (``model_layout``); other keywords go to ``AsyncClient.spill`` (ttl_s, hint,
    model_fingerprint, ...); ``model_fingerprint`` defaults to the model's own
    (``model_fingerprint(model)``)."""
    spec = model_layout(model, bits, format=format)
    tokens = _token_array(token_ids)
    persistent = await asyncio.to_thread(cache_streams, spec, model, cache, len(tokens))
    spill_options["model_fingerprint"] = await _fingerprint(
        model, spill_options.get("model_fingerprint"))

    async def spill() -> SpillResult:
        return await client.spill(tenant, session_id, spec, tokens, persistent,
                                  generation=generation, ack=ack, **spill_options)

    try:
        return await spill()
    except UnknownLayout:  # this server has not seen the model's layout yet
        await client.register_layout(spec)
        return await spill()


async def async_resume_cache(client: AsyncClient, tenant: str, session_id: str,
                             model: HFModel, *,
                             replay_tokens: int = 0, replay: str = "auto",
                             model_fingerprint: str | None = None
                             ) -> tuple[DynamicCache, torch.Tensor]:
    """(cache, token_ids (n,) int64) of a spilled session, as the model's own cache
    classes; DeepseekV4's window rebuilt by replaying at least ``replay_tokens`` (0: the
    server's default R; 128 locally) tokens as ``replay`` says (module docstring).
    ``model_fingerprint``: stated for the check (None: the model's own; "": unchecked);
    a session of other weights raises ``ModelMismatch``."""
    if replay not in REPLAY_MODES:
        raise InvalidRequest(f"replay must be one of {REPLAY_MODES}, got {replay!r}")
    layouts = {spec.layout_id for spec in candidate_layouts(model.config)}  # refuses first
    stated = await _fingerprint(model, model_fingerprint)
    if not is_deepseek_v4(model.config):
        session = await client.restore(tenant, session_id, want_window=False,
                                       model_fingerprint=stated)
        spec = _model_spec(layouts, session)
        return standard_cache(spec, model, session.persistent), _ids(session)
    resumed: RestoredSession | None = None
    if replay != "local":
        try:
            resumed = await client.resume(tenant, session_id, replay_tokens=replay_tokens,
                                          model_fingerprint=stated)
        except PreconditionFailed:  # the server cannot replay this layout (or not with
            if replay == "server":  # these weights: the restore below says if it is ours)
                raise
    session = resumed if resumed is not None else await client.restore(
        tenant, session_id, want_window=False, model_fingerprint=stated)
    spec = _model_spec(layouts, session)
    ids = _ids(session)
    return await asyncio.to_thread(_deepseek_cache, spec, model, session, ids,
                                   replay_tokens or 128), ids


def _model_spec(layouts: set[str], session: RestoredSession) -> LayoutSpec:
    if session.layout.layout_id not in layouts:
        raise LayoutMismatch(f"the session was spilled with layout {session.layout.layout_id}, "
                             f"which is not this model's cache (its layouts: {sorted(layouts)})")
    return session.layout


def _ids(session: RestoredSession) -> torch.Tensor:
    return torch.from_numpy(session.token_ids.astype(np.int64))


def _deepseek_cache(spec: LayoutSpec, model: HFModel, session: RestoredSession, ids: torch.Tensor,
                    r: int) -> DynamicCache:
    window = session.window
    if window is None:  # rebuilt here, by the model itself
        window, _ = deepseek_v4.replay_window(spec, model, ids, session.persistent, r)
    return deepseek_v4.build_cache(spec, model, len(ids), session.persistent, window)


def spill_cache(client: Client, tenant: str, session_id: str, model: HFModel,
                cache: DynamicCache, token_ids: TokenIds, *, generation: int,
                ack: str | None = None, bits: int | None = None, format: str | None = None,
                **spill_options: Any) -> SpillResult:
    """The blocking twin of ``async_spill_cache`` (a ``kvtier.Client``)."""
    return client._run(async_spill_cache(client._async, tenant, session_id, model, cache,
                                         token_ids, generation=generation, ack=ack, bits=bits,
                                         format=format, **spill_options))


def resume_cache(client: Client, tenant: str, session_id: str, model: HFModel, *,
                 replay_tokens: int = 0, replay: str = "auto",
                 model_fingerprint: str | None = None) -> tuple[DynamicCache, torch.Tensor]:
    """The blocking twin of ``async_resume_cache`` (a ``kvtier.Client``)."""
    return client._run(async_resume_cache(client._async, tenant, session_id, model,
                                          replay_tokens=replay_tokens, replay=replay,
                                          model_fingerprint=model_fingerprint))
