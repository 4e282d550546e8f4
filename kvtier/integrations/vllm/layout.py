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

Value formats (``value_format``): "auto" stores the engine's KV dtype exactly (bf16 as bf16,
fp16 as fp16: a lossless passthrough); "int8" symmetric int8 with one fp16 scale per token
and head; "fp8_e4m3" e4m3 codes with one float32 scale per layer and chunk (its absmax /
448). The last two are lossy: a loaded block differs from a recomputed one by the rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

from kvstore.format.errors import UnsupportedModel
from kvstore.format.layout import LayoutSpec, Stream
from kvstore.format.tensor_parallel import shard_heads, tp_shard_layout

STREAMS = ("k", "v")
# the engine's KV dtype -> the stream format that holds it exactly
EXACT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


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


def cache_shape(vllm_config, kv_cache_config) -> CacheShape:
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
                      tp_size=tp_size)


def stream_format(value_format: str, dtype: torch.dtype) -> str:
    """The stream format (``kvstore.format.layout.FORMATS``) of ``value_format`` for KV of
    ``dtype``."""
    if value_format != "auto":
        return value_format
    if dtype not in EXACT:
        raise UnsupportedModel(
            f"kvtier connector: value_format auto stores the KV dtype exactly and no stream "
            f"format holds {dtype} exactly: run vLLM with dtype bfloat16 or float16, or set "
            "value_format int8 or fp8_e4m3")
    return EXACT[dtype]


def value_stream(name: str, fmt: str, shape: CacheShape) -> Stream:
    entry = (shape.kv_heads, shape.head_size)
    if fmt == "int8":
        return Stream(name, entry, bits=8, group_size=shape.head_size, layers=shape.layers)
    bits = 8 if fmt == "fp8_e4m3" else 16
    return Stream(name, entry, bits=bits, layers=shape.layers, format=fmt)


def engine_layout(shape: CacheShape, value_format: str) -> LayoutSpec:
    """The layout of the whole engine's cache (every head)."""
    fmt = stream_format(value_format, shape.dtype)
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
