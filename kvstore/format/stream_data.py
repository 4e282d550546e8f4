"""A stream's tensors as the codec takes and gives them (docs/wire-format.md "Value
formats"). Importing this loads no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

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
