"""The kvtier layout of a vLLM engine's paged KV cache, one per tensor-parallel rank.

The engine's layout has two persistent streams ``k`` and ``v``, each entry ``(kv_heads,
head_size)`` per token, ``layers`` = the model's attention layers, ``chunk_tokens`` =
vLLM's block size (one chunk is one paged block of every layer), the model's vocabulary, no
window, and it requires a model fingerprint (the weights' identity is in every chunk key).
Its name states the shape and the value format,
``vllm-<layers>x<kv_heads>x<head_size>-b<block>-<format>``. A rank stores its own heads
under its own layout (``kvstore.format.tensor_parallel.tp_shard_layout``: the name gains
``-tp<size>r<rank>``), so ranks of one engine, and engines of another TP size, never share
a chunk.

Value formats (``value_format``): "auto" stores each block's engine page as it lies in the
cache (below); "portable" the engine's KV dtype exactly, token-major (bf16 as bf16, fp16
as fp16: a lossless passthrough any engine of the model can read); "int8" symmetric int8
with one fp16 scale per token and head; "fp8_e4m3" e4m3 codes with one float32 scale per
layer and chunk (its absmax / 448). The last two are lossy: a loaded block differs from a
recomputed one by the rounding.

Engine pages ("auto"): one stream ``page`` of format ``page`` (opaque bytes), one entry per
block (``tokens_per_entry`` = the block size), entry ``(kv_heads, bytes per head)``: a
chunk's layer section is exactly the bytes of ``kv_cache[layer][block]``, whatever the
attention backend keeps there, so a save is one gather and a load one scatter of whole
blocks. Which arrangement those bytes are in is the engine's (``block_arrangement``: on the
CPU ``cpu_attn.<isa>``, vec and amx lay a block out differently; elsewhere the attention
backend's name), and it is in the layout's name, so the layout id, hence every chunk key,
binds it: an engine whose blocks are laid out otherwise never finds those chunks. The name
is ``vllm-<arrangement>-<layers>x<kv_heads>x<head_size>-b<block>-<dtype>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

from kvstore.format.errors import UnsupportedModel
from kvstore.format.layout import LayoutSpec, Stream
from kvstore.format.tensor_parallel import shard_heads, tp_shard_layout

STREAMS = ("k", "v")  # a token-major layout's
PAGE = "page"  # an engine-page layout's one stream
# the engine's KV dtype -> the stream format that holds it exactly
EXACT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# the engine's KV dtype as an engine-page layout's name states it
PAGE_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class CacheShape:
    """What the engine's paged cache holds per token and layer, every rank together."""

    layers: int
    kv_heads: int  # the model's, before tensor parallelism shards them
    head_size: int
    block_size: int
    vocab_size: int
    dtype: torch.dtype
    tp_size: int
    # how the engine lays a block out (``block_arrangement``); "" when not known, and then
    # there is no engine-page layout
    arrangement: str = ""


def cache_shape(vllm_config: Any, kv_cache_config: Any) -> CacheShape:  # vLLM's configs
    """The shape of the engine's cache: one KV cache group of full attention layers with
    plain (unquantized) K and V of one head size; any other cache is ``UnsupportedModel``."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedModel(f"kvtier connector: the model has {len(groups)} KV cache groups "
                               "(e.g. sliding-window or Mamba layers); only a single group of "
                               "full-attention layers is supported")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
        raise UnsupportedModel(f"kvtier connector: KV cache spec {type(spec).__name__} is not "
                               "supported (full attention only; MLA and sliding windows are not)")
    if spec.head_size_v != spec.head_size:
        raise UnsupportedModel("kvtier connector: K and V head sizes differ "
                               f"({spec.head_size}, {spec.head_size_v})")
    if spec.kv_quant_mode != KVQuantMode.NONE:
        raise UnsupportedModel(f"kvtier connector: quantized KV cache ({spec.kv_quant_mode}) "
                               "is not supported; run with kv_cache_dtype auto")
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    if len(shard_heads(kv_heads, tp_size, 0)) != spec.num_kv_heads:
        raise UnsupportedModel(f"kvtier connector: a rank's cache holds {spec.num_kv_heads} "
                               f"of the model's {kv_heads} KV heads over {tp_size} ranks, not "
                               "what kvtier's tensor-parallel rule shards")
    return CacheShape(layers=len(groups[0].layer_names), kv_heads=kv_heads,
                      head_size=spec.head_size, block_size=spec.block_size,
                      vocab_size=vllm_config.model_config.get_vocab_size(), dtype=spec.dtype,
                      tp_size=tp_size, arrangement=block_arrangement(vllm_config, spec))


def block_arrangement(vllm_config: Any, spec: FullAttentionSpec) -> str:
    """How the engine's attention backend lays out a block's bytes, as both the scheduler
    and every worker can tell from the config: on the CPU ``cpu_attn.<isa>`` (the ISA path
    CPU_ATTN picks for the model's dtype, block and head size: vec, vec16, amx, neon, ...
    each arrange K and V their own way), elsewhere the backend's name, lower case (the
    worker checks its layers run that backend, ``check_arrangement``)."""
    from vllm.platforms import current_platform

    cache_dtype = vllm_config.cache_config.cache_dtype
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa: str = _get_attn_isa(vllm_config.model_config.dtype, spec.block_size,
                                 spec.head_size, cache_dtype)
        return "cpu_attn." + isa
    from vllm.v1.attention.selector import get_attn_backend

    name: str = get_attn_backend(spec.head_size, spec.dtype, cache_dtype).get_name()
    return name.lower()


def check_arrangement(shape: CacheShape, attention_layers: list[Any]) -> None:
    """The layers (vLLM ``Attention`` modules) really lay blocks out as ``shape`` says
    (``UnsupportedModel``): an engine-page chunk is only ever read by its arrangement. A
    CPU_ATTN layer that has not been told its ISA yet is checked by its backend alone."""
    for layer in attention_layers:
        got = layer.attn_backend.get_name().lower()
        if got == "cpu_attn" and getattr(layer, "isa", None):
            got += f".{layer.isa}"
        if got != shape.arrangement and not shape.arrangement.startswith(got + "."):
            raise UnsupportedModel(f"kvtier connector: the attention layers lay blocks out "
                                   f"as {got}, the layout says {shape.arrangement}")


def stream_format(value_format: str, dtype: torch.dtype) -> str:
    """The stream format (``kvstore.format.layout.FORMATS``) of ``value_format`` for KV of
    ``dtype``: "page" for "auto" (the engine's own block bytes)."""
    if value_format == "auto":
        return PAGE
    if value_format != "portable":
        return value_format
    if dtype not in EXACT:
        raise UnsupportedModel(
            f"kvtier connector: value_format portable stores the KV dtype exactly and no "
            f"stream format holds {dtype} exactly: run vLLM with dtype bfloat16 or float16, "
            "or set value_format auto, int8 or fp8_e4m3")
    return EXACT[dtype]


def value_stream(name: str, fmt: str, shape: CacheShape) -> Stream:
    entry = (shape.kv_heads, shape.head_size)
    if fmt == "int8":
        return Stream(name, entry, bits=8, group_size=shape.head_size, layers=shape.layers)
    bits = 8 if fmt == "fp8_e4m3" else 16
    return Stream(name, entry, bits=bits, layers=shape.layers, format=fmt)


def page_layout(shape: CacheShape) -> LayoutSpec:
    """The engine-page layout of the whole engine's cache (every head): each chunk holds,
    per layer, its block's bytes as the engine lays them out (module docstring)."""
    if not shape.arrangement:
        raise UnsupportedModel("kvtier connector: the engine's block arrangement is not known: "
                               "value_format auto needs it; set value_format portable")
    if shape.dtype not in PAGE_DTYPES:
        raise UnsupportedModel(f"kvtier connector: engine pages of {shape.dtype} KV are not "
                               f"supported ({sorted(PAGE_DTYPES.values())})")
    # a block's K and V of one head: 2 * block_size * head_size values
    head_bytes = 2 * shape.block_size * shape.head_size * shape.dtype.itemsize
    stream = Stream(PAGE, (shape.kv_heads, head_bytes), bits=8, format=PAGE,
                    tokens_per_entry=shape.block_size, layers=shape.layers)
    name = (f"vllm-{shape.arrangement}-{shape.layers}x{shape.kv_heads}x{shape.head_size}-"
            f"b{shape.block_size}-{PAGE_DTYPES[shape.dtype]}")
    return LayoutSpec(name, (stream,), chunk_tokens=shape.block_size,
                      vocab_size=shape.vocab_size, requires_model_fingerprint=True,
                      replayer="none", notes=f"a vLLM engine's paged blocks, {shape.arrangement}")


def engine_layout(shape: CacheShape, value_format: str) -> LayoutSpec:
    """The layout of the whole engine's cache (every head)."""
    fmt = stream_format(value_format, shape.dtype)
    if fmt == PAGE:
        return page_layout(shape)
    name = (f"vllm-{shape.layers}x{shape.kv_heads}x{shape.head_size}-b{shape.block_size}-"
            f"{fmt.replace('_', '')}")
    return LayoutSpec(name, tuple(value_stream(s, fmt, shape) for s in STREAMS),
                      chunk_tokens=shape.block_size, vocab_size=shape.vocab_size,
                      requires_model_fingerprint=True, replayer="none",
                      notes="a vLLM engine's paged K/V")


def rank_layout(shape: CacheShape, rank: int, value_format: str) -> LayoutSpec:
    """The layout of tensor-parallel rank ``rank``'s cache: its own heads."""
    if not 0 <= rank < shape.tp_size:
        raise UnsupportedModel(f"kvtier connector: rank {rank} of a TP size {shape.tp_size}")
    return tp_shard_layout(engine_layout(shape, value_format), shape.tp_size, rank)


def rank_session(session_id: str, shape: CacheShape, rank: int) -> str:
    """The session id rank ``rank`` spills under: the id itself on one rank, else one
    session per rank (each holds its own heads, under its own layout)."""
    return session_id if shape.tp_size == 1 else f"{session_id}.tp{shape.tp_size}r{rank}"
