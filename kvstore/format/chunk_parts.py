"""Where each (stream, layer, part) of a chunk lives in its payload, for one layout and
token count: the one source of the byte order, shared by encoder and decoder, cached per
shape. Plain numpy: reading the plan loads no torch; a part's ``dtype`` does.

Parts per stream format (``layout.FORMATS``): codes (layers, entries, *codes_shape) of
the format's code dtype; group-scaled formats (int4, int8) add scales (layers, entries,
scales_per_entry) float16; a tensor-scaled one (fp8_e4m3) adds scales (layers, 1)
float32, the chunk's one scale per layer, which must be finite and > 0."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.format.errors import ChunkCorrupt
from kvstore.format.layout import LayoutSpec, Stream

if TYPE_CHECKING:
    import torch

PART_CODES, PART_SCALES = 0, 1
# torch dtype names of the scales, by the format's scales kind
SCALES_DTYPE_NAMES = {"group": "float16", "tensor": "float32"}
ITEMSIZE = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
            "float32": 4}


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a part's dtype name (imports torch: tensors are asked for)."""
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


def code_dtype(stream: Stream) -> torch.dtype:
    """The torch dtype of ``stream``'s codes (its format's)."""
    return torch_dtype(stream.value_format.code_dtype)


def scales_shape(stream: Stream, entries: int) -> tuple[int, ...] | None:
    """Per-layer shape of one chunk's scales of ``stream`` over ``entries`` entries; None
    when its format has no scales."""
    kind = stream.value_format.scales
    if kind == "none":
        return None
    return (entries, stream.scales_per_entry) if kind == "group" else (1,)


def scales_dtype(stream: Stream) -> torch.dtype | None:
    """The torch dtype of ``stream``'s scales; None when its format has none."""
    kind = stream.value_format.scales
    return None if kind == "none" else torch_dtype(SCALES_DTYPE_NAMES[kind])


@dataclass(frozen=True)
class PartPlan:
    stream: Stream
    stream_index: int
    part: int  # PART_CODES or PART_SCALES
    first_section: int  # row of layer 0 in the section table
    offset: int  # payload offset of layer 0; layers follow back to back
    layer_bytes: int
    shape: tuple[int, ...]  # (layers, entries, ...) of the whole part
    dtype_name: str  # the format's code dtype, or SCALES_DTYPE_NAMES

    @property
    def dtype(self) -> torch.dtype:
        """The part's torch dtype."""
        return torch_dtype(self.dtype_name)


@dataclass(frozen=True)
class ChunkPlan:
    parts: tuple[PartPlan, ...]
    # (sections, 3) uint64: the table's first 24 bytes per row (ids, offset, length), as
    # encode_chunk writes them; a decoder compares the stored table against it in one call.
    table_head: np.ndarray
    payload_bytes: int


def streams_of(spec: LayoutSpec, ephemeral: bool) -> tuple[Stream, ...]:
    return spec.ephemeral_streams if ephemeral else spec.persistent_streams


def max_chunk_tokens(spec: LayoutSpec, ephemeral: bool, names: tuple[str, ...] | None = None
                     ) -> int:
    """The most tokens one chunk of these streams may cover: a persistent chunk its
    chunk_tokens; an ephemeral one the window W for window streams and m - 1 for the
    pending rows (every stream it carries must fit). With the section table checked
    against the plan, this bounds every decoded size by the layout alone."""
    if not ephemeral:
        return spec.chunk_tokens
    bounds = [spec.pending_tokens_max if s.pending else spec.window_tokens
              for s in spec.ephemeral_streams if names is None or s.name in names]
    return min(bounds, default=0)


@functools.lru_cache(maxsize=512)
def chunk_plan(
    spec: LayoutSpec, num_tokens: int, ephemeral: bool, names: tuple[str, ...] | None = None
) -> ChunkPlan:
    """``names`` picks a subset of the streams (ephemeral chunks only); None: all of them.

    Stream indices in the table stay those of the full stream list, so a subset chunk
    says which streams it carries.
    """
    parts, rows, offset, section = [], [], 0, 0
    for index, stream in enumerate(streams_of(spec, ephemeral)):
        if names is not None and stream.name not in names:
            continue
        entries = stream.entries_for(num_tokens)
        kinds = [(PART_CODES, (stream.layers, entries, *stream.codes_shape),
                  stream.value_format.code_dtype)]
        scales = scales_shape(stream, entries)
        if scales is not None:
            kinds.append((PART_SCALES, (stream.layers, *scales),
                          SCALES_DTYPE_NAMES[stream.value_format.scales]))
        for part, shape, dtype in kinds:
            layer_bytes = int(np.prod(shape[1:], dtype=np.int64)) * ITEMSIZE[dtype]
            parts.append(PartPlan(stream, index, part, section, offset, layer_bytes, shape, dtype))
            for layer in range(stream.layers):
                ids = index | (layer << 16) | (part << 32)  # u2 stream, u2 layer, u1 part, 3 pad
                rows.append((ids, offset, layer_bytes))
                offset += layer_bytes
                section += 1
    table_head = np.array(rows, dtype=np.uint64).reshape(-1, 3)
    return ChunkPlan(tuple(parts), table_head, offset)


def tensor_scale_fault(stream: str, scales: np.ndarray) -> str | None:
    """Why float32 ``scales`` of a tensor-scaled (fp8) stream are not all usable scales
    (each must be finite and > 0: a dequantizer multiplies by it), or None."""
    bad = ~(np.isfinite(scales) & (scales > 0))
    if not bad.any():
        return None
    return (f"stream {stream}: an fp8 scale must be finite and > 0, got "
            f"{float(scales[bad][0])!r}")


def check_tensor_scales(plan: ChunkPlan, payload: np.ndarray) -> None:
    """ChunkCorrupt unless every fp8 scale in a chunk's raw ``payload`` (of ``plan``) is
    finite and > 0."""
    for p in plan.parts:
        if p.part == PART_SCALES and p.stream.value_format.scales == "tensor":
            scales = np.frombuffer(payload, "<f4", count=p.stream.layers, offset=p.offset)
            fault = tensor_scale_fault(p.stream.name, scales)
            if fault:
                raise ChunkCorrupt(fault)
