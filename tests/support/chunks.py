"""Chunk-format fixtures for the format tests: two layouts, random streams for a layout,
a chunk resealed around a hostile fp8 scale, exact comparison of decoded streams, and
Hypothesis strategies for random layouts."""

from __future__ import annotations

import struct

import torch
import xxhash
from hypothesis import strategies as st

from kvstore.format import chunk as codec
from kvstore.format.chunk import StreamData, read_header
from kvstore.format.chunk_parts import PART_SCALES, chunk_plan, code_dtype
from kvstore.format.layout import FORMATS, BaselineKV, LayoutSpec, Stream
from kvstore.format.registry import get_layout

BUNDLED = get_layout("kvtier-bundled")
MIXED = LayoutSpec(
    "codec-test",
    (
        Stream("lat", (48,), bits=4, group_size=16, tokens_per_entry=4, layers=3),
        Stream("idx", (2, 10), bits=8, group_size=10, tokens_per_entry=2),
        Stream("raw", (6,), bits=16, layers=2),
        Stream("win", (3, 8), bits=8, group_size=8, layers=2, persistent=False),
    ),
    chunk_tokens=12,
    window_tokens=30,
)


def make_streams(spec, num_tokens, seed=0, ephemeral=False):
    """Random codes and scales of every format: uint8 / int8 codes any byte, bf16 / fp16
    gaussian values, fp8 any byte (NaN codes included: compared bitwise), fp8 scales
    in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in spec.ephemeral_streams if ephemeral else spec.persistent_streams:
        e = s.entries_for(num_tokens)
        dtype = code_dtype(s)
        if s.format in ("bf16", "fp16"):
            codes = torch.randn(s.layers, e, *s.codes_shape, generator=g).to(dtype)
        else:
            codes = torch.randint(
                0, 256, (s.layers, e, *s.codes_shape), generator=g, dtype=torch.uint8
            ).view(dtype)
        scales = None
        if s.value_format.scales == "group":
            scales = torch.rand(s.layers, e, s.scales_per_entry, generator=g).half()
        elif s.value_format.scales == "tensor":
            scales = torch.rand(s.layers, 1, generator=g) + 0.5
        out[s.name] = StreamData(codes, scales)
    return out


def resealed(buf: bytes, spec: LayoutSpec, value: float) -> bytes:
    """``buf`` with its first fp8 scale replaced by ``value`` and every checksum made to
    agree: what a hostile writer could send."""
    h = read_header(buf)
    payload = bytearray(buf[h.payload_offset:])
    part = next(p for p in chunk_plan(spec, h.num_tokens, False).parts if p.part == PART_SCALES)
    payload[part.offset:part.offset + 4] = struct.pack("<f", value)
    table = h.sections.copy()
    table["checksum"] = [xxhash.xxh3_64_intdigest(bytes(payload[o:o + n]))
                         for o, n in zip(table["offset"].tolist(), table["length"].tolist(),
                                         strict=True)]
    fields = list(codec._HEADER.unpack_from(buf))
    fields[-1] = xxhash.xxh3_64_intdigest(bytes(payload))
    head = codec._HEADER.pack(*fields) + table.tobytes()
    return head + codec._CHECK.pack(xxhash.xxh3_64_intdigest(head)) + bytes(payload)


def assert_same(decoded, original):
    assert decoded.keys() == original.keys()
    for name, data in original.items():
        assert torch.equal(decoded[name].codes.view(torch.uint8), data.codes.view(torch.uint8))
        if data.scales is None:
            assert decoded[name].scales is None
        else:
            assert torch.equal(
                decoded[name].scales.view(torch.uint8), data.scales.view(torch.uint8)
            )


# Random layouts for property tests: persistent streams only (no window), chunk_tokens a
# multiple of 12 so every m in 1..4 divides it.
@st.composite
def streams(draw, name: str | None = None) -> Stream:
    fmt = draw(st.sampled_from(sorted(FORMATS)))
    last = 2 * draw(st.integers(1, 12))
    group = 0 if FORMATS[fmt].scales != "group" else draw(st.sampled_from(
        [g for g in range(1, last + 1) if last % g == 0]))
    shape = (*draw(st.lists(st.integers(1, 4), max_size=1)), last)
    return Stream(name or draw(st.sampled_from("abcdef")), shape, bits=FORMATS[fmt].bits,
                  group_size=group, tokens_per_entry=draw(st.integers(1, 4)),
                  layers=draw(st.integers(1, 6)), format=fmt)


@st.composite
def layouts(draw) -> LayoutSpec:
    names = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=3, unique=True))
    baseline = draw(st.none() | st.builds(BaselineKV, st.integers(1, 8), st.integers(1, 8),
                                          st.integers(1, 128)))
    return LayoutSpec(draw(st.sampled_from(["p", "q"])),
                      tuple(draw(streams(n)) for n in names),
                      chunk_tokens=12 * draw(st.integers(1, 4)), baseline=baseline,
                      layer_modes=tuple(draw(st.lists(st.sampled_from(["full", "reuse"]),
                                                      max_size=3))))
