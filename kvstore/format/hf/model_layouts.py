"""The kvtier layout of a transformers model's cache, derived from ``model.config``.

- Standard models (a ``DynamicCache`` of full-attention and sliding-window layers, as
  transformers builds it for the config, ``attention.layer_windows``: Llama, Mistral,
  Gemma2...): each kind of layer has its own streams of (kv_heads, head_dim) per token,
  in one of ``STANDARD_FORMATS``: bf16 or fp16 (the model's own 16-bit float, lossless; a
  16-bit format that would round the model's values is refused), int8, int4 (symmetric,
  one fp16 scale per token and 32 channels of a head: 0.28x bf16) or fp8_e4m3 (one scale
  per layer per chunk). The full-attention layers' ``k`` / ``v`` are persistent (every
  token, in chunks); the sliding layers' ``window.k`` / ``window.v`` are the window
  streams (W = the window - 1, the rows such a layer keeps: the trailing
  min(n, W) rows at the session's end, in the window blob; an all-sliding model has no
  persistent stream: its chunks carry the token ids alone). One sliding window per model
  (several are ``UnsupportedModel``); the layer modes (``full`` / ``sliding-W``) map the
  cache's layers onto the streams in order and bind the window into the layout's id.
  Nothing for the server to replay (``replayer`` none); the transformers integration can
  replay a lost window itself (``kvtier.integrations.transformers``, ``window="replay"``).
  Every other kind of layer is ``UnsupportedModel``.
- DeepseekV4 (``model_type == "deepseek_v4"``): the compressor entries of the CSA layers
  (``csa.kv``, m = 4), their Lightning Indexer entries (``csa.index``, m = 4) and the HCA
  layers' entries (``hca.kv``, m = 128), persistent at 4 or 8 bits. Ephemeral, rebuilt by
  the ``transformers-deepseek-v4`` replayer: the window K=V of every layer (``window``,
  at most sliding_window - 1 rows), and the compressors' partial-block state: the
  projected (kv, gate) rows of the unfinished block (``csa.buffer``, ``csa.index_buffer``,
  ``hca.buffer``; pending, fewer than m rows) and the Ca half of the last complete CSA
  window (``csa.overlap``, ``csa.index_overlap``; m rows).

A layout's name says the family and precision and ends in a digest of its shape, so two
configs never claim one name with different streams.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvstore.format.errors import InvalidRequest, UnsupportedModel
from kvstore.format.hf.attention import HFConfig, layer_windows, text_config
from kvstore.format.layout import FORMATS, LayoutSpec, Stream

CSA, HCA, SLIDING = ("compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention")
GROUP = {4: 32, 8: 64}  # values per fp16 scale, as the shipped presets use
STANDARD_FORMATS = ("bf16", "fp16", "int8", "int4", "fp8_e4m3")
DEEPSEEK_V4_BITS = (4, 8)
# A model's 16-bit float dtype (str(torch dtype)) and the format that stores it exactly.
FLOAT_FORMATS = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


def is_deepseek_v4(config: HFConfig) -> bool:
    return getattr(config, "model_type", "") == "deepseek_v4"


def layout_for(config: HFConfig, bits: int | None = None, *, format: str | None = None,
               dtype: object = None) -> LayoutSpec:  # a torch dtype, named by str()
    """The layout of this config's cache at ``bits`` or in ``format`` (default: 16 bits
    for standard models, 4 for DeepseekV4). A standard model's 16 bits are ``dtype``'s
    format (the model's torch dtype: fp16 for float16, else bf16); a 16-bit ``format``
    that is not a bf16 / fp16 model's own is ``InvalidRequest`` (it would round every
    value)."""
    if is_deepseek_v4(config):
        if format is not None:
            raise InvalidRequest("DeepseekV4's layouts are chosen by bits (4 or 8), not by "
                                 f"format ({format!r})")
        return deepseek_v4_layout(config, 4 if bits is None else bits)
    own = FLOAT_FORMATS.get(str(dtype))
    if format is None:
        format = (None if bits is None else {8: "int8", 4: "int4"}.get(bits)) or own or "bf16"
    if format not in STANDARD_FORMATS or bits not in (None, FORMATS[format].bits):
        raise InvalidRequest(f"a standard model's cache is stored as one of "
                             f"{STANDARD_FORMATS} (bits 16, 8 or 4), not {format} at {bits} "
                             "bits")
    if own and FORMATS[format].scales == "none" and format != own:
        raise InvalidRequest(f"the model's cache is {own}: format {format} would round every "
                             f"value; store it as {own} (lossless) or quantized (int8, "
                             "int4, fp8_e4m3)")
    return standard_layout(config, format)


def candidate_layouts(config: HFConfig) -> list[LayoutSpec]:
    """Every layout a session of this config may have been spilled with."""
    if is_deepseek_v4(config):
        return [deepseek_v4_layout(config, b) for b in DEEPSEEK_V4_BITS]
    return [standard_layout(config, f) for f in STANDARD_FORMATS]


def _group(bits: int, dim: int) -> int:
    return 0 if bits == 16 else math.gcd(GROUP[bits], dim)


def _named(spec: LayoutSpec, family: str, tag: str) -> LayoutSpec:
    return replace(spec, name=f"hf-{family}-{tag}-{replace(spec, name='x').layout_hash:016x}"[:64])


def _kv_shape(text: HFConfig) -> tuple[int, int]:
    """(kv_heads, head_dim) of every layer of a decoder config; ``UnsupportedModel`` when
    the layers differ or the config does not say."""
    shapes = set()
    try:
        for layer in text.per_layer_config:  # each layer's own view, heterogeneous or not
            attention_heads = layer.num_attention_heads
            # configs without the field (GPT-2...) have one KV head per attention head
            heads = getattr(layer, "num_key_value_heads", None) or attention_heads
            shapes.add((heads, getattr(layer, "head_dim", None)
                        or layer.hidden_size // attention_heads))
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
        raise UnsupportedModel(f"{text.model_type}: its config does not state the cache's "
                               f"shape ({exc})") from None
    if len(shapes) != 1:
        raise UnsupportedModel(f"{text.model_type}: per-layer KV shapes {sorted(shapes)} are "
                               "not supported (one (kv_heads, head_dim) for every layer)")
    return shapes.pop()


def _cache_streams(text: HFConfig
                   ) -> tuple[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]]:
    """(name, entry shape) of what a layer's cache holds as its keys and as its values:
    K and V of (kv_heads, head_dim), or for a latent (MLA) cache (DeepseekV2/V3) one
    shared head per token, the compressed latent (``kv_lora_rank``) and the rope key
    (``qk_rope_head_dim``)."""
    rank, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
    if rank and rope:
        return ("latent", (1, rank)), ("rope", (1, rope))
    shape = _kv_shape(text)
    return ("k", shape), ("v", shape)


def standard_layout(config: HFConfig, format: str = "bf16") -> LayoutSpec:
    if format not in STANDARD_FORMATS:
        raise InvalidRequest(f"a standard model's cache is stored as one of "
                             f"{STANDARD_FORMATS}, not {format}")
    value = FORMATS[format]
    windows = layer_windows(config)
    text = text_config(config)
    kind = text.model_type
    (key_name, key_shape), (value_name, value_shape) = _cache_streams(text)
    try:
        vocab_size = text.vocab_size
    except AttributeError:
        raise UnsupportedModel(f"{kind}: its config states no vocab_size") from None
    sliding = sorted({w for w in windows if w})
    if len(sliding) > 1:
        raise UnsupportedModel(f"{kind}: sliding windows of several sizes {sliding} are not "
                               "supported (one window for every sliding layer)")
    full_layers = windows.count(0)
    sliding_layers = len(windows) - full_layers

    def streams(prefix: str, layers: int, persistent: bool) -> tuple[Stream, ...]:
        return tuple(Stream(prefix + name, shape, bits=value.bits,
                            group_size=math.gcd(GROUP[value.bits], shape[-1])
                            if value.scales == "group" else 0,
                            layers=layers, persistent=persistent, format=format)
                     for name, shape in ((key_name, key_shape), (value_name, value_shape))
                     ) if layers else ()

    # modes only when some layer slides, so full-attention layouts keep their ids
    modes = tuple(f"sliding-{w}" if w else "full" for w in windows) if sliding else ()
    spec = LayoutSpec(name="x", streams=streams("", full_layers, True)
                      + streams("window.", sliding_layers, False),
                      chunk_tokens=64, vocab_size=vocab_size, layer_modes=modes,
                      window_tokens=sliding[0] - 1 if sliding else 0,
                      notes=f"transformers {kind}: {len(windows)} layers, {key_name} "
                      f"{key_shape}, {value_name} {value_shape} per token; {full_layers} "
                      "full-attention layers persistent" + (
                          f", {sliding_layers} sliding (W = {sliding[0]}) in the window "
                          f"blob, their last {sliding[0] - 1} rows" if sliding else ""))
    return _named(spec, kind.replace("_", "-"), format)


def deepseek_v4_layout(config: HFConfig, bits: int = 4) -> LayoutSpec:
    if bits not in DEEPSEEK_V4_BITS:
        raise InvalidRequest(f"DeepseekV4's compressed entries are stored at 4 or 8 bits, "
                             f"not {bits}")
    types = list(config.layer_types)
    csa, hca = types.count(CSA), types.count(HCA)
    m_csa = config.compress_rates[CSA]
    m_hca = config.compress_rates[HCA]
    d, di = config.head_dim, config.index_head_dim

    def entries(name: str, dim: int, m: int, layers: int) -> Stream:
        return Stream(name, (dim,), bits=bits, group_size=_group(bits, dim), tokens_per_entry=m,
                      layers=layers)

    def state(name: str, shape: tuple[int, ...], layers: int, pending: bool = True) -> Stream:
        return Stream(name, shape, bits=16, layers=layers, persistent=False, pending=pending)

    streams = []
    if csa:
        streams += [entries("csa.kv", d, m_csa, csa), entries("csa.index", di, m_csa, csa)]
    if hca:
        streams.append(entries("hca.kv", d, m_hca, hca))
    streams.append(Stream("window", (d,), bits=16, layers=len(types), persistent=False))
    if csa:
        # (kv, gate) rows: CSA projects 2 x head_dim per token (the Ca and Cb series)
        streams += [state("csa.buffer", (2, 2 * d), csa),
                    state("csa.index_buffer", (2, 2 * di), csa),
                    state("csa.overlap", (2, d), csa, pending=False),
                    state("csa.index_overlap", (2, di), csa, pending=False)]
    if hca:
        streams.append(state("hca.buffer", (2, d), hca))
    lcm = math.lcm(*(s.tokens_per_entry for s in streams if s.persistent)) if csa or hca else 1
    spec = LayoutSpec(
        name="x", streams=tuple(streams), chunk_tokens=lcm * max(1, 256 // lcm),
        layer_modes=tuple({CSA: "csa", HCA: "hca", SLIDING: "sliding"}[t] for t in types),
        vocab_size=config.vocab_size, window_tokens=config.sliding_window,
        replayer="transformers-deepseek-v4",
        notes=f"transformers DeepseekV4: {csa} CSA (m={m_csa}), {hca} HCA (m={m_hca}), "
        f"{len(types) - csa - hca} sliding layers, window {config.sliding_window}")
    return _named(spec, "deepseek-v4", f"int{bits}")


def persistent_bf16_bytes_per_token(spec: LayoutSpec) -> float:
    """What the persistent streams would take per token unquantized (bf16): the cache
    the model itself keeps per token."""
    return sum(s.layers * s.values_per_entry * 2 / s.tokens_per_entry
               for s in spec.persistent_streams)
