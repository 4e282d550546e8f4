"""The kvtier layout of a vLLM engine's paged KV cache, one per tensor-parallel rank.

A rank holds the K and V of its own kv heads for every attention layer; its layout has two
persistent streams ``k`` and ``v``, each entry ``(kv_heads_of_the_rank, head_size)`` per
token, ``layers`` = the model's attention layers, ``chunk_tokens`` = vLLM's block size (one
chunk is one paged block of every layer), the model's vocabulary, no window, and it requires
a model fingerprint (the weights' identity is in every chunk key). Its name states the shape,
the value format and the rank,
``vllm-<layers>x<heads>x<head_size>-b<block>-<format>-tp<size>r<rank>``, so ranks of one
engine, and engines of another TP size, never share a chunk.

Value formats (``value_format``): "auto" stores the engine's KV dtype exactly (bf16 KV as
bf16 codes: a lossless passthrough); "int8" stores symmetric int8 with one fp16 scale per
token and head (lossy: a loaded block differs from a recomputed one by the rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

from kvstore.format.errors import UnsupportedModel
from kvstore.format.layout import LayoutSpec, Stream

STREAMS = ("k", "v")
LABELS = {"auto": "bf16", "int8": "int8", "fp8_e4m3": "fp8e4m3"}  # value_format in names


@dataclass(frozen=True)
class CacheShape:
    """What one rank's paged cache holds per token and layer."""

    layers: int
    kv_heads: int  # of one rank
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
    kind = type(spec).__name__
    if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
        raise UnsupportedModel(f"kvtier connector: KV cache spec {kind} is not supported "
                               "(full attention only; MLA and sliding windows are not)")
    if spec.head_size_v != spec.head_size:
        raise UnsupportedModel("kvtier connector: K and V head sizes differ "
                               f"({spec.head_size}, {spec.head_size_v})")
    if spec.kv_quant_mode != KVQuantMode.NONE:
        raise UnsupportedModel(f"kvtier connector: quantized KV cache ({spec.kv_quant_mode}) "
                               "is not supported; run with kv_cache_dtype auto")
    return CacheShape(
        layers=len(groups[0].layer_names), kv_heads=spec.num_kv_heads,
        head_size=spec.head_size, block_size=spec.block_size,
        vocab_size=vllm_config.model_config.get_vocab_size(), dtype=spec.dtype,
        tp_size=vllm_config.parallel_config.tensor_parallel_size)


def value_stream(name: str, value_format: str, shape: CacheShape) -> Stream:
    """The stream ``name`` of ``value_format`` for a cache of ``shape``."""
    entry = (shape.kv_heads, shape.head_size)
    if value_format == "auto":
        if shape.dtype != torch.bfloat16:
            raise UnsupportedModel(
                f"kvtier connector: value_format auto stores the KV dtype exactly and this "
                f"kvtier has no lossless stream for {shape.dtype}: run vLLM with dtype "
                "bfloat16, or set value_format int8")
        return Stream(name, entry, bits=16, layers=shape.layers)
    if value_format == "int8":
        return Stream(name, entry, bits=8, group_size=shape.head_size, layers=shape.layers)
    raise UnsupportedModel(f"kvtier connector: value_format {value_format} is not available "
                           "in this kvtier (auto, int8)")


def rank_layout(shape: CacheShape, rank: int, value_format: str) -> LayoutSpec:
    """The layout of tensor-parallel rank ``rank``'s cache."""
    if not 0 <= rank < shape.tp_size:
        raise UnsupportedModel(f"kvtier connector: rank {rank} of a TP size {shape.tp_size}")
    name = (f"vllm-{shape.layers}x{shape.kv_heads}x{shape.head_size}-b{shape.block_size}-"
            f"{LABELS[value_format]}-tp{shape.tp_size}r{rank}")
    return LayoutSpec(name, tuple(value_stream(s, value_format, shape) for s in STREAMS),
                      chunk_tokens=shape.block_size, vocab_size=shape.vocab_size,
                      requires_model_fingerprint=True, replayer="none",
                      notes="a vLLM engine's paged K/V of one tensor-parallel rank")


def rank_session(session_id: str, shape: CacheShape, rank: int) -> str:
    """The session id rank ``rank`` spills under: the id itself on one rank, else one
    session per rank (each holds its own heads, under its own layout)."""
    return session_id if shape.tp_size == 1 else f"{session_id}.tp{shape.tp_size}r{rank}"
