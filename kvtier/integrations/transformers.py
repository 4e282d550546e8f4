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
layers, the classes transformers builds for the config) store each kind of layer in its
own streams (docs/wire-format.md 2.8), at 16 bits in the model's own float (bf16 or fp16,
lossless; ``bits=16``, the default; a float32 model's at bf16) or quantized (``bits=8``:
int8; ``bits=4``: int4, one fp16 scale per token and 32 channels of a head;
``format="fp8_e4m3"``: fp8 with one scale per layer per chunk); a 16-bit ``format``
other than a bf16 / fp16 model's own is refused, never a silent rounding. Full-attention
(and latent MLA) layers are persistent; a sliding layer's last W - 1 rows, all it keeps,
are the session's window, which comes back exactly while a memory tier holds it. Where
it does not (or a spill dropped it, ``window="replay"``), ``window="replay"`` on resume
rebuilds it by a bounded replay through this process's model
(``kvstore.format.hf.sliding_replay``: an approximation), else the resume raises
``ReplayUnavailable``. Any other model (other layer kinds, encoder-decoder, per-layer
head shapes, several sliding windows) is ``UnsupportedModel``, raised before anything
is sent. DeepseekV4 keeps its compressor and indexer entries at 4
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
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from kvstore.format.chunk import StreamData
from kvstore.format.errors import (
    DataLoss,
    InvalidRequest,
    LayoutMismatch,
    PreconditionFailed,
    ReplayUnavailable,
    UnknownLayout,
    UnsupportedModel,
)
from kvstore.format.hf import deepseek_v4, sliding_replay
from kvstore.format.hf.attention import HFModel, layer_windows, text_config
from kvstore.format.hf.model_layouts import candidate_layouts, is_deepseek_v4, layout_for
from kvstore.format.hf.quant import decode_values, encode_values
from kvstore.format.layout import LayoutSpec, Stream
from kvstore.format.model_identity import module_fingerprint
from kvtier.client import AsyncClient
from kvtier.sync import Client
from kvtier.types import RestoredSession, SpillResult, TokenIds

REPLAY_MODES = ("auto", "server", "local")
# a standard model's sliding layers: their rows stored as the window, or dropped and
# replayed on resume (the truncated-window approximation, ``sliding_replay``)
WINDOW_MODES = ("keep", "replay")


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
    """The persistent streams of ``cache`` (which must cover ``num_tokens`` tokens): a
    standard model's full-attention layers (``cache_window`` has its sliding ones)."""
    _check_cache(cache, num_tokens)
    if is_deepseek_v4(model.config):
        return deepseek_v4.persistent_streams(spec, model.config, cache)
    windows = layer_windows(model.config)
    _check_layers(cache, windows, num_tokens)
    return _layer_streams(spec, model, cache, windows, True, num_tokens)


def cache_window(spec: LayoutSpec, model: HFModel, cache: DynamicCache, num_tokens: int
                 ) -> dict[str, StreamData] | None:
    """A standard model's sliding layers as the window streams: each layer's last
    min(n, W - 1) rows, which are all it keeps; None when no layer slides."""
    if not spec.ephemeral_streams or is_deepseek_v4(model.config):
        return None
    _check_cache(cache, num_tokens)
    windows = layer_windows(model.config)
    _check_layers(cache, windows, num_tokens)
    return _layer_streams(spec, model, cache, windows, False,
                          min(num_tokens, spec.window_tokens))


def _check_cache(cache: DynamicCache, num_tokens: int) -> None:
    if not isinstance(cache, DynamicCache):
        raise InvalidRequest(f"expected a transformers DynamicCache, got {type(cache).__name__}")
    held = cache.get_seq_length()
    if held != num_tokens:
        raise InvalidRequest(f"the cache covers {held} tokens and {num_tokens} token ids were "
                             "given (after generate, the last token is not in the cache)")


def _layer_streams(spec: LayoutSpec, model: HFModel, cache: DynamicCache, windows: tuple[int, ...],
                   persistent: bool, rows: int) -> dict[str, StreamData]:
    """The last ``rows`` rows of the layers of one kind (persistent: full attention, else
    sliding), as that kind's two streams (keys, values); {} when the model has none."""
    names = [s.name for s in spec.streams if s.persistent == persistent]
    if not names:
        return {}
    layers = [layer for layer, window in zip(_dynamic(cache), windows, strict=True)
              if bool(window) != persistent]
    out = {}
    for name, held in zip(names, ("keys", "values"), strict=True):
        stream = spec.stream(name)
        tensors = [getattr(layer, held) for layer in layers]
        for t in tensors:
            if (t.shape[1], t.shape[3]) != stream.entry_shape:
                raise UnsupportedModel(
                    f"{text_config(model.config).model_type}: a layer holds {held} of shape "
                    f"{tuple(t.shape)}, its config gives (1, {stream.entry_shape[0]}, tokens, "
                    f"{stream.entry_shape[1]}): {_cache_kind(cache)} the layout does not "
                    "describe is not supported")
        # (1, heads, held, head_dim) per layer -> (layers, rows, heads, head_dim)
        values = torch.stack([t[0, :, t.shape[2] - rows:].transpose(0, 1) for t in tensors])
        out[name] = encode_values(stream, values)
    return out


def _cache_kind(cache: DynamicCache) -> str:
    """What the layers hold, named for an error: a latent (MLA) cache has one head whose
    keys and values differ in width (DeepseekV2/V3: the latent and the rope part)."""
    layer = _dynamic(cache)[0]
    if layer.keys.shape[1] == 1 and layer.keys.shape[3] != layer.values.shape[3]:
        return "a latent (MLA) cache"
    return "a cache"


def _rows_kept(window: int, num_tokens: int) -> int:
    """Rows a layer of ``window`` (0: full attention) holds after ``num_tokens`` tokens."""
    return num_tokens if window == 0 else min(num_tokens, window - 1)


def _check_layers(cache: DynamicCache, windows: tuple[int, ...], n: int) -> None:
    """``cache`` has the layers transformers builds for the model (``windows``), batch 1,
    every layer holding what its kind keeps after ``n`` tokens."""
    if len(cache.layers) != len(windows):
        raise LayoutMismatch(f"the cache has {len(cache.layers)} layers, the model "
                             f"{len(windows)}")
    for i, (layer, window) in enumerate(zip(_dynamic(cache), windows, strict=True)):
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


def standard_cache(spec: LayoutSpec, model: HFModel, persistent: dict[str, StreamData],
                   window: dict[str, StreamData] | None, num_tokens: int) -> DynamicCache:
    """A ``DynamicCache`` of the model's layers (its own classes) from the full layers'
    streams and the sliding layers' window streams (keys, then values, in spec order)."""
    dtype = model.get_input_embeddings().weight.dtype
    windows = layer_windows(model.config)
    stored = persistent | (window or {})
    # per kind: (keys, values), each (layers of the kind, rows, heads, head_dim)
    kinds = {kind: [iter(decode_values(s, stored[s.name], spec.chunk_tokens).to(dtype))
                    if s.name in stored else _no_rows(s, dtype)
                    for s in spec.streams if s.persistent == kind]
             for kind in (True, False)}
    cache = DynamicCache(config=model.config)
    for layer, w in zip(_dynamic(cache), windows, strict=True):
        # (rows, heads, head_dim) -> (1, heads, rows, head_dim)
        keys, values = (next(x).transpose(0, 1)[None] for x in kinds[not w])
        # a sliding layer without its window holds nothing, for a replay to rebuild
        if not (w and window is None) and keys.shape[2] != _rows_kept(w, num_tokens):
            raise DataLoss(f"the session holds {keys.shape[2]} rows of a layer of window {w}, "
                           f"which keeps {_rows_kept(w, num_tokens)} of {num_tokens} tokens")
        keys, values = keys.contiguous(), values.contiguous()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if w:
            layer.cumulative_length = num_tokens  # every token seen, the last W - 1 kept
    return cache


def _no_rows(stream: Stream, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """Per layer of ``stream``: (0, *entry_shape), a window that was not kept."""
    return iter(torch.zeros(stream.layers, 0, *stream.entry_shape, dtype=dtype))


async def async_spill_cache(client: AsyncClient, tenant: str, session_id: str, model: HFModel,
                            cache: DynamicCache, token_ids: TokenIds, *, generation: int,
                            ack: str | None = None, bits: int | None = None,
                            format: str | None = None, window: str = "keep",
                            **spill_options: Any) -> SpillResult:
    """Spill ``cache`` (covering ``token_ids``) as generation ``generation`` through a
    ``kvtier.AsyncClient``; ``bits`` or ``format`` picks the layout's precision
    (``model_layout``); ``window``: "keep" sends the sliding layers' rows (the window
    blob), "replay" drops them (a resume replays them); other keywords go to
    ``AsyncClient.spill`` (ttl_s, hint, model_fingerprint, ...); ``model_fingerprint``
    defaults to the model's own (``model_fingerprint(model)``)."""
    if window not in WINDOW_MODES:
        raise InvalidRequest(f"window must be one of {WINDOW_MODES}, got {window!r}")
    spec = model_layout(model, bits, format=format)
    tokens = _token_array(token_ids)
    persistent = await asyncio.to_thread(cache_streams, spec, model, cache, len(tokens))
    rows = None if window == "replay" else await asyncio.to_thread(
        cache_window, spec, model, cache, len(tokens))
    spill_options["model_fingerprint"] = await _fingerprint(
        model, spill_options.get("model_fingerprint"))

    async def spill() -> SpillResult:
        return await client.spill(tenant, session_id, spec, tokens, persistent, window=rows,
                                  generation=generation, ack=ack, **spill_options)

    try:
        return await spill()
    except UnknownLayout:  # this server has not seen the model's layout yet
        await client.register_layout(spec)
        return await spill()


async def async_resume_cache(client: AsyncClient, tenant: str, session_id: str,
                             model: HFModel, *,
                             replay_tokens: int = 0, replay: str = "auto",
                             window: str = "keep", model_fingerprint: str | None = None
                             ) -> tuple[DynamicCache, torch.Tensor]:
    """(cache, token_ids (n,) int64) of a spilled session, as the model's own cache
    classes; DeepseekV4's window rebuilt by replaying at least ``replay_tokens`` (0: the
    server's default R; 128 locally) tokens as ``replay`` says (module docstring). A
    standard model's sliding layers come back as stored; where their window is not held,
    ``window="replay"`` rebuilds it by replaying the last ``replay_tokens`` tokens here
    (0: W - 1; ``sliding_replay``), "keep" raises ``ReplayUnavailable``.
    ``model_fingerprint``: stated for the check (None: the model's own; "": unchecked);
    a session of other weights raises ``ModelMismatch``."""
    if replay not in REPLAY_MODES:
        raise InvalidRequest(f"replay must be one of {REPLAY_MODES}, got {replay!r}")
    layouts = {spec.layout_id for spec in candidate_layouts(model.config)}  # refuses first
    stated = await _fingerprint(model, model_fingerprint)
    if window not in WINDOW_MODES:
        raise InvalidRequest(f"window must be one of {WINDOW_MODES}, got {window!r}")
    if not is_deepseek_v4(model.config):
        session = await client.restore(tenant, session_id, model_fingerprint=stated)
        spec = _model_spec(layouts, session)
        ids = _ids(session)
        return await asyncio.to_thread(_standard_cache, spec, model, session, ids, window,
                                       replay_tokens), ids
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


def _standard_cache(spec: LayoutSpec, model: HFModel, session: RestoredSession, ids: torch.Tensor,
                    window: str, r: int) -> DynamicCache:
    n = len(ids)
    if not spec.ephemeral_streams or session.window is not None:
        return standard_cache(spec, model, session.persistent, session.window, n)
    if window != "replay":
        raise ReplayUnavailable(
            "the session's sliding-layer window is not held (spilled with window='replay', "
            "or gone with the memory tiers it never leaves): resume with window='replay' to "
            "rebuild it by a bounded replay (an approximation)")
    r = sliding_replay.check_replay_tokens(spec.window_tokens + 1, n,
                                           r or spec.window_tokens)
    cache = standard_cache(spec, model, session.persistent, None, n)
    return sliding_replay.replay_sliding_layers(model, cache, ids, r)


def _deepseek_cache(spec: LayoutSpec, model: HFModel, session: RestoredSession, ids: torch.Tensor,
                    r: int) -> DynamicCache:
    window = session.window
    if window is None:  # rebuilt here, by the model itself
        window, _ = deepseek_v4.replay_window(spec, model, ids, session.persistent, r)
    return deepseek_v4.build_cache(spec, model, len(ids), session.persistent, window)


def spill_cache(client: Client, tenant: str, session_id: str, model: HFModel,
                cache: DynamicCache, token_ids: TokenIds, *, generation: int,
                ack: str | None = None, bits: int | None = None, format: str | None = None,
                window: str = "keep", **spill_options: Any) -> SpillResult:
    """The blocking twin of ``async_spill_cache`` (a ``kvtier.Client``)."""
    return client._run(async_spill_cache(client._async, tenant, session_id, model, cache,
                                         token_ids, generation=generation, ack=ack, bits=bits,
                                         format=format, window=window, **spill_options))


def resume_cache(client: Client, tenant: str, session_id: str, model: HFModel, *,
                 replay_tokens: int = 0, replay: str = "auto", window: str = "keep",
                 model_fingerprint: str | None = None) -> tuple[DynamicCache, torch.Tensor]:
    """The blocking twin of ``async_resume_cache`` (a ``kvtier.Client``)."""
    return client._run(async_resume_cache(client._async, tenant, session_id, model,
                                          replay_tokens=replay_tokens, replay=replay,
                                          window=window, model_fingerprint=model_fingerprint))
