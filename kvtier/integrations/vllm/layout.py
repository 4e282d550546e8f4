"""The kvtier layouts of a vLLM engine's paged KV cache: one per KV cache group kvtier
stores and tensor-parallel rank.

Groups (``cache_groups``, ``group_policy``): vLLM splits a model's layers into KV cache
groups, one spec each. A full-attention group is stored whole; a sliding-window group
only as its trailing window (``CacheShape.window_start``); a group the engine rebuilds
(``bounded_replay``, DeepSeek-V4.1's compressor ring, no KV transfer) is not stored; a
latent (MLA) group is stored as its layers' raw page bytes (``raw_layout``). Any other
spec is ``UnsupportedModel`` naming it. Each stored group has its own layout, whose name
says which group it is (``group_tag``). What follows describes a K/V attention group's
layout.

The engine's layout has two persistent streams ``k`` and ``v``, each entry ``(kv_heads,
head_size)`` per token, ``layers`` = the model's attention layers, ``chunk_tokens`` =
vLLM's block size (one chunk is one paged block of every layer), the model's vocabulary, no
window, and it requires a model fingerprint (the weights' identity is in every chunk key).
Its name states the shape, the value format and the vocabulary,
``vllm-<layers>x<kv_heads>x<head_size>-b<block>-<format>-v<vocab>``: a server knows one
layout by each name, so two models alike but for their vocabulary need two names. A rank
stores its own heads under its own layout (``kvstore.format.tensor_parallel.tp_shard_layout``:
the name gains ``-tp<size>r<rank>``), so ranks of one engine, and engines of another TP
size, never share a chunk.

Value formats (``value_format``): "auto" stores each block's engine page as it lies in the
cache (below); "portable" the engine's KV dtype exactly, token-major (bf16 as bf16, fp16
as fp16: a lossless passthrough any engine of the model can read); "int8" symmetric int8
with one fp16 scale per token and head; "int4" symmetric int4 with one fp16 scale per token
and 32 channels of a head (0.28x the bf16 bytes; measured on a trained Llama in
bench/REPORT.md); "fp8_e4m3" e4m3 codes with one float32 scale per layer and chunk (its
absmax / 448). The last three are lossy: a loaded block differs from a
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

import math
from dataclasses import dataclass, replace
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
INT4_GROUP = 32  # channels of one head per fp16 scale (fewer when the head size is not a multiple)


# How each kind of KV cache group is kept (``group_policy``):
FULL = "full"  # every block, from the first: stored whole
SLIDING = "sliding"  # a window: only the trailing window's blocks at a stored prefix end
REBUILT = "rebuilt"  # the engine rebuilds it (bounded replay, or no KV transfer): not stored
KINDS = (FULL, SLIDING, REBUILT)


@dataclass(frozen=True)
class CacheShape:
    """What one KV cache group of the engine's paged cache holds per token and layer,
    every rank together."""

    layers: int
    kv_heads: int  # the model's, before tensor parallelism shards them
    head_size: int
    block_size: int
    vocab_size: int
    dtype: torch.dtype
    tp_size: int
    # how the engine lays a block out (``block_arrangement``); "" when not known, and then
    # there is no engine-page layout; "raw" for a latent (MLA) group: its layers' block
    # bytes are opaque, whatever their views' shapes
    arrangement: str = ""
    kind: str = FULL  # KINDS
    window: int = 0  # SLIDING: vLLM's sliding_window (a token attends this many, itself too)
    group: int = 0  # the group's index in vLLM's kv_cache_groups
    layer_names: tuple[str, ...] = ()  # the group's layers, in vLLM's order
    spec_name: str = "FullAttentionSpec"  # the vLLM spec class the group came from
    # "raw": each layer's bytes per block (its page's real content), in layer order
    page_bytes: tuple[int, ...] = ()

    @property
    def stored(self) -> bool:
        return self.kind != REBUILT

    def window_start(self, end: int) -> int:
        """The first block a prefix hit ending at token ``end`` needs of this group: 0 for
        a full group; for a sliding one the block holding the oldest token the next one
        attends (vLLM's ``SlidingWindowManager``: the blocks below are null)."""
        if self.kind != SLIDING:
            return 0
        return max(0, end - self.window + 1) // self.block_size


def _attention_shape(vllm_config: Any, spec: Any, group: int, layer_names: list[str],  # vLLM's
                     kind: str, window: int) -> CacheShape:
    """A group of K/V attention layers (full or sliding): plain K and V of one head
    size, heads sharded as kvtier's tensor-parallel rule does."""
    name = type(spec).__name__
    if spec.head_size_v != spec.head_size:
        raise UnsupportedModel(f"kvtier connector: {name}: K and V head sizes differ "
                               f"({spec.head_size}, {spec.head_size_v})")
    if spec.kv_quant_mode != KVQuantMode.NONE:
        raise UnsupportedModel(f"kvtier connector: {name}: quantized KV cache "
                               f"({spec.kv_quant_mode}) is not supported; run with "
                               "kv_cache_dtype auto")
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    if len(shard_heads(kv_heads, tp_size, 0)) != spec.num_kv_heads:
        raise UnsupportedModel(f"kvtier connector: a rank's cache holds {spec.num_kv_heads} "
                               f"of the model's {kv_heads} KV heads over {tp_size} ranks, not "
                               "what kvtier's tensor-parallel rule shards")
    return CacheShape(layers=len(layer_names), kv_heads=kv_heads, head_size=spec.head_size,
                      block_size=spec.block_size,
                      vocab_size=vllm_config.model_config.get_vocab_size(), dtype=spec.dtype,
                      tp_size=tp_size, arrangement=block_arrangement(vllm_config, spec),
                      kind=kind, window=window, group=group, layer_names=tuple(layer_names),
                      spec_name=name)


def _raw_shape(vllm_config: Any, spec: Any, group: int, layer_names: list[str], kind: str,
               window: int) -> CacheShape:  # vLLM's config and spec
    """A latent (MLA) group: each layer's block is the engine's own bytes, the real content
    of the layer's page (``real_page_size_bytes``: vLLM may pad a page up to an alignment,
    and the view a worker is handed holds only the content). Each layer's own spec is the
    worker's alone (``UniformTypeKVCacheSpecs``): the scheduler's group spec is its first
    layer's, so the scheduler takes these sizes from the workers (``KVTierHandshake``), and
    names the group by that first layer's spec, as the worker does."""
    per_layer = getattr(spec, "kv_cache_specs", None) or {}
    first = next(iter(per_layer.values())) if per_layer else spec
    name = type(first).__name__
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if tp_size != 1:
        raise UnsupportedModel(f"kvtier connector: {name} with tensor parallelism "
                               f"({tp_size} ranks) is not supported")
    pages = tuple(per_layer.get(n, spec).real_page_size_bytes for n in layer_names)
    return CacheShape(layers=len(layer_names), kv_heads=1, head_size=first.head_size,
                      block_size=spec.block_size,
                      vocab_size=vllm_config.model_config.get_vocab_size(),
                      dtype=first.dtype, tp_size=1, arrangement="raw", kind=kind,
                      window=window, group=group, layer_names=tuple(layer_names),
                      spec_name=name, page_bytes=pages)


def with_worker_pages(groups: list[CacheShape], page_bytes: dict[int, tuple[int, ...]]
                      ) -> list[CacheShape]:
    """The scheduler's ``groups`` with each stored latent group's layers' page sizes as the
    workers hold them (``page_bytes``: group -> its layers' bytes per block, from
    ``KVTierHandshake``), so both sides derive the same layout; a latent group the workers
    did not describe is ``UnsupportedModel``."""
    out = []
    for group in groups:
        if group.arrangement == "raw" and group.stored:
            pages = tuple(page_bytes.get(group.group, ()))
            if len(pages) != group.layers:
                raise UnsupportedModel(f"kvtier connector: the workers gave {len(pages)} page "
                                       f"sizes for group {group.group}'s {group.layers} layers")
            group = replace(group, page_bytes=pages)
        out.append(group)
    return out


def worker_pages(groups: list[CacheShape]) -> dict[int, tuple[int, ...]]:
    """What a worker tells the scheduler (``with_worker_pages``): per stored latent group,
    its layers' bytes per block."""
    return {g.group: g.page_bytes for g in groups if g.arrangement == "raw" and g.stored}


def group_policy(spec: Any, enable_kv_transfer: bool = True) -> tuple[str, str, int]:
    """(kind, how its bytes are kept, window) of a vLLM KV cache spec: how kvtier keeps
    the group. "kv": plain K/V attention blocks; "raw": the engine's page bytes (MLA
    latents, DeepSeek-V4's compressed KV, indexer keys, compressor states). A spec kvtier
    cannot keep is ``UnsupportedModel`` naming it."""
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    inner = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
    if isinstance(spec, UniformTypeKVCacheSpecs) and not spec.kv_cache_specs:
        raise UnsupportedModel("kvtier connector: an empty UniformTypeKVCacheSpecs group")
    kind = type(inner)
    # bounded replay, or DeepSeek-V4.1's compressor ring (CircularBufferSpec: the open
    # compression group's keys, no prefix's; vLLM's own prefix cache skips it too, and
    # the replay of the hit's window refills it)
    if not enable_kv_transfer or getattr(spec, "prefix_replay_tokens", 0) > 0 \
            or isinstance(inner, CircularBufferSpec):
        return REBUILT, "", getattr(inner, "sliding_window", 0) or 0
    if kind is FullAttentionSpec:
        # a sliding window with the hybrid manager off: the engine keeps every block
        return FULL, "kv", 0
    if kind is MLAAttentionSpec:
        return FULL, "raw", 0
    if kind is SlidingWindowSpec:
        return SLIDING, "kv", inner.sliding_window
    if kind is SlidingWindowMLASpec:
        return SLIDING, "raw", inner.sliding_window
    raise UnsupportedModel(f"kvtier connector: KV cache spec {kind.__name__} is not "
                           "supported (kept: FullAttentionSpec, SlidingWindowSpec, "
                           "MLAAttentionSpec, SlidingWindowMLASpec; bounded-replay groups "
                           "are rebuilt by the engine)")


def cache_groups(vllm_config: Any, kv_cache_config: Any) -> list[CacheShape]:  # vLLM's
    """Every KV cache group of the engine, in vLLM's order, each with how kvtier keeps
    it (``group_policy``); a model whose every group is rebuilt has nothing to keep
    (``UnsupportedModel``)."""
    shapes = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind, keep, window = group_policy(spec, getattr(group, "enable_kv_transfer", True))
        make = _raw_shape if keep == "raw" else _attention_shape
        # by layer number, as the worker takes them: a chunk's layer order
        names = sorted(group.layer_names, key=layer_number)
        if kind == REBUILT:
            shapes.append(CacheShape(layers=len(names), kv_heads=1, head_size=1,
                                     block_size=spec.block_size,
                                     vocab_size=vllm_config.model_config.get_vocab_size(),
                                     dtype=torch.uint8, tp_size=1, kind=REBUILT,
                                     window=window, group=index, layer_names=tuple(names),
                                     spec_name=type(spec).__name__))
            continue
        shapes.append(make(vllm_config, spec, index, names, kind, window))
    if not any(s.stored for s in shapes):
        raise UnsupportedModel("kvtier connector: every KV cache group of the model is "
                               "rebuilt by the engine: nothing to keep")
    return shapes


def layer_number(name: str) -> int:
    """The layer number in a layer's name (vLLM's ``extract_layer_index``); -1 for a name
    without one (kept in place by a stable sort)."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        index: int = extract_layer_index(name)
        return index
    except (AssertionError, ValueError):
        return -1


def cache_shape(vllm_config: Any, kv_cache_config: Any) -> CacheShape:  # vLLM's configs
    """The first group kvtier stores (``cache_groups``)."""
    return next(s for s in cache_groups(vllm_config, kv_cache_config) if s.stored)


def group_line(shape: CacheShape) -> str:
    """How a group is kept, for the connector's startup line."""
    what = {FULL: "stored whole", SLIDING: f"trailing {shape.window}-token window stored",
            REBUILT: "rebuilt by the engine, not stored"}[shape.kind]
    return f"{shape.group} {shape.spec_name} x{shape.layers}: {what}"


def hit_alignment(groups: list[CacheShape], kv_cache_config: Any = None) -> int:
    """The tokens a hit is a whole multiple of: every group's block (vLLM's hybrid
    coordinator hits at their least common multiple) and vLLM's own alignment."""
    align = math.lcm(*(g.block_size for g in groups))
    extra = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
    return math.lcm(align, extra) if extra else align


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
            "or set value_format auto, int8, int4 or fp8_e4m3")
    return EXACT[dtype]


def value_stream(name: str, fmt: str, shape: CacheShape) -> Stream:
    entry = (shape.kv_heads, shape.head_size)
    if fmt == "int8":
        return Stream(name, entry, bits=8, group_size=shape.head_size, layers=shape.layers)
    if fmt == "int4":
        return Stream(name, entry, bits=4, group_size=math.gcd(INT4_GROUP, shape.head_size),
                      layers=shape.layers)
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
    name = (f"vllm-{group_tag(shape)}{shape.arrangement}-{shape.layers}x{shape.kv_heads}x"
            f"{shape.head_size}-b{shape.block_size}-{PAGE_DTYPES[shape.dtype]}-v{shape.vocab_size}")
    return LayoutSpec(name, (stream,), chunk_tokens=shape.block_size,
                      vocab_size=shape.vocab_size, requires_model_fingerprint=True,
                      replayer="none", notes=f"a vLLM engine's paged blocks, {shape.arrangement}")


def group_tag(shape: CacheShape) -> str:
    """What a layout's name says of its group beyond the shape: nothing for the first
    group when it is full attention of K/V (the names kvtier always had); else
    ``g<index>-`` (vLLM splits a hybrid model's layers into groups alike in all but
    their layers: each keeps its own chunks), then ``swa<window>-`` for a sliding group,
    ``<spec>-`` (lower case, e.g. ``mlaattentionspec-``) for a group of raw pages."""
    tag = "" if shape.group == 0 and shape.kind == FULL else f"g{shape.group}-"
    tag += f"swa{shape.window}-" if shape.kind == SLIDING else ""
    if shape.arrangement == "raw":
        tag += shape.spec_name.lower() + "-"
    return tag


def raw_layout(shape: CacheShape) -> LayoutSpec:
    """A latent group's layout: per layer, its block's bytes as the engine holds them,
    one opaque entry per block (a page need not be a whole number of bytes per token:
    DeepSeek-V4's ratio-128 layer keeps 1,168 B per 256-token block); layers of one page
    size share a stream (``page``, then ``page1``, ... in order of first appearance), so a
    chunk is each layer's page back to back. The name states the group kind, its layers'
    page sizes, the block, dtype and vocabulary (as every vLLM layout's name does):
    ``vllm-[swa<window>-]<spec>-<layers>x<page bytes>[_<page bytes>...]-b<block>-<dtype>``
    ``-v<vocab>``."""
    sizes = list(dict.fromkeys(shape.page_bytes))
    streams = tuple(Stream(raw_stream(n), (1, size), bits=8, format=PAGE,
                           tokens_per_entry=shape.block_size,
                           layers=shape.page_bytes.count(size))
                    for n, size in enumerate(sizes))
    dtype = PAGE_DTYPES.get(shape.dtype, str(shape.dtype).removeprefix("torch."))
    name = (f"vllm-{group_tag(shape)}{shape.layers}x{'_'.join(map(str, sizes))}-"
            f"b{shape.block_size}-{dtype}-v{shape.vocab_size}")
    return LayoutSpec(name, streams, chunk_tokens=shape.block_size,
                      vocab_size=shape.vocab_size, requires_model_fingerprint=True,
                      replayer="none", notes=f"a vLLM engine's {shape.spec_name} pages")


def raw_stream(n: int) -> str:
    """The name of a raw layout's n-th page size's stream."""
    return PAGE if n == 0 else f"{PAGE}{n}"


def engine_layout(shape: CacheShape, value_format: str) -> LayoutSpec:
    """The layout of the whole engine's cache (every head)."""
    if shape.arrangement == "raw":
        return raw_layout(shape)
    fmt = stream_format(value_format, shape.dtype)
    if fmt == PAGE:
        return page_layout(shape)
    name = (f"vllm-{group_tag(shape)}{shape.layers}x{shape.kv_heads}x{shape.head_size}-"
            f"b{shape.block_size}-{fmt.replace('_', '')}-v{shape.vocab_size}")
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
