"""The Triton backend: the wrappers of every kernel, under the names kernels.ops dispatches to.

Imported lazily by kernels.backend (see there why)."""

from kernels.triton_attention import sparse_compressed_attention, window_attention
from kernels.triton_indexer import indexer_scores
from kernels.triton_quant import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from kernels.triton_topk import indexer_topk

__all__ = [
    "dequantize_int4",
    "dequantize_int8",
    "indexer_scores",
    "indexer_topk",
    "pack_int4",
    "quantize_int4",
    "quantize_int8",
    "sparse_compressed_attention",
    "unpack_int4",
    "window_attention",
]
