"""A stream's tensors as the codec takes and gives them, and the check of the one value
a format constrains: an fp8 stream's per-tensor scales (docs/wire-format.md "Value
formats"). Importing this loads no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.format.chunk_parts import PART_SCALES, ChunkPlan
from kvstore.format.errors import ChunkCorrupt

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StreamData:
    """One stream's share of a chunk (or of a run of chunks), every owning layer."""

    # (layers, entries, *codes_shape) of the format's code dtype: uint8 (int4 packed),
    # int8, bfloat16, float16 or float8_e4m3fn
    codes: torch.Tensor
    # int4/int8: (layers, entries, scales_per_entry) float16; fp8_e4m3: (layers, chunks)
    # float32, column c the scale of the codes of chunk c (one column in one chunk);
    # None for bf16 and fp16
    scales: torch.Tensor | None


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
