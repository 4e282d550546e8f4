"""Value formats (docs/wire-format.md "Value formats"): the default formats keep every
layout's JSON and id, the new ones validate their fields, size every bound, round-trip
exactly (bf16, fp16, fp8 codes) or within e4m3's error (fp8 from floats), and hostile
scales, dtypes and shapes are refused at the boundary."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from kvstore.format.checks import check_window, window_bytes_max
from kvstore.format.chunk import (
    StreamData,
    decode_chunk,
    encode_chunk,
    max_encoded_bytes,
    read_header,
    verify_chunk,
)
from kvstore.format.chunk_parts import PART_SCALES, chunk_plan
from kvstore.format.chunk_run import decode_chunks
from kvstore.format.errors import ChunkCorrupt, InvalidRequest, LayoutMismatch
from kvstore.format.hf.quant import FP8_MAX, decode_values, encode_values
from kvstore.format.keys import chunk_digest
from kvstore.format.layer_sections import EMPTY_XXH3, chunk_table, section_order
from kvstore.format.layout import LayoutSpec, Stream, layout_from_json, layout_to_json
from kvstore.format.registry import all_layouts
from kvstore.format.window import encode_window
from kvtier.codec import LayerAssembler, decode_persistent, encode_session
from proto import kvtier_pb2 as pb
from tests.support.chunks import assert_same, make_streams, resealed

FP8 = Stream("k8", (2, 4), bits=8, layers=2, format="fp8_e4m3")
FP16 = Stream("h", (3, 4), bits=16, layers=3, format="fp16")
BF16 = Stream("b", (4,), bits=16)
SPEC = LayoutSpec("formats-test", (FP8, FP16, BF16,
                                   Stream("w8", (4,), bits=8, format="fp8_e4m3", layers=2,
                                          persistent=False)),
                  chunk_tokens=8, window_tokens=6)


def test_default_formats_keep_every_layouts_json_and_id():
    defaults = {4: "int4", 8: "int8", 16: "bf16"}
    # every layout of default formats (others, an fp16 model's say, may be registered)
    for spec in (s for s in all_layouts()
                 if all(x.format == defaults[x.bits] for x in s.streams)):
        text = layout_to_json(spec)
        assert '"format"' not in text, spec.name
        explicit = dataclasses.replace(spec, streams=tuple(
            dataclasses.replace(s, format=s.format) for s in spec.streams))
        assert explicit == spec and explicit.layout_id == spec.layout_id
    s = Stream("x", (8,), bits=8, group_size=4)
    assert s.format == "int8" and s == Stream("x", (8,), bits=8, group_size=4, format="int8")
    # a client may state a default format: it is canonicalised away
    obj = json.loads(layout_to_json(LayoutSpec("d", (s,), chunk_tokens=4)))
    obj["streams"][0]["format"] = "int8"
    assert layout_to_json(layout_from_json(json.dumps(obj))) == \
        layout_to_json(LayoutSpec("d", (s,), chunk_tokens=4))


def test_a_new_format_is_in_the_json_and_the_id():
    text = layout_to_json(SPEC)
    assert text.count('"format":"fp8_e4m3"') == 2 and text.count('"format":"fp16"') == 1
    assert text.count('"format"') == 3  # bf16 is the default for 16 bits
    assert layout_from_json(text) == SPEC
    as_bf16 = LayoutSpec("x", (Stream("h", (4,), bits=16),), chunk_tokens=8)
    as_fp16 = LayoutSpec("x", (Stream("h", (4,), bits=16, format="fp16"),), chunk_tokens=8)
    assert as_bf16.layout_id != as_fp16.layout_id


@pytest.mark.parametrize("kwargs", [
    dict(bits=8, format="fp16"),
    dict(bits=16, format="fp8_e4m3"),
    dict(bits=16, format="fp16", group_size=4),
    dict(bits=8, format="fp8_e4m3", group_size=4),
    dict(bits=8, format="int9", group_size=4),
    dict(bits=4, format="int4", group_size=0),
])
def test_invalid_format_combinations_are_refused(kwargs):
    with pytest.raises(InvalidRequest):
        Stream("x", (8,), **kwargs)


def test_a_non_string_format_in_json_is_refused():
    obj = json.loads(layout_to_json(SPEC))
    obj["streams"][0]["format"] = 8
    with pytest.raises(InvalidRequest, match="format"):
        layout_from_json(json.dumps(obj))


def test_sizes_count_codes_and_the_per_chunk_scales():
    assert FP8.bytes_per_entry == 8 and FP8.scales_per_entry == 0 and FP8.bytes_per_chunk == 8
    assert FP16.bytes_per_entry == 24 and FP16.bytes_per_chunk == 0
    assert SPEC.persistent_bytes_per_token == 2 * 8 + 8 / 8 + 3 * 24 + 8
    assert SPEC.ephemeral_bytes_per_token == 2 * 4 + 8 / 6
    for n in (1, 5, 8):
        buf = encode_chunk(SPEC, 0, np.arange(n), make_streams(SPEC, n, n))
        plan = chunk_plan(SPEC, n, False)
        assert read_header(buf).raw_payload_len == plan.payload_bytes == \
            n * (2 * 8 + 3 * 24 + 8) + 2 * 4
        assert len(buf) <= max_encoded_bytes(SPEC, n, False)
    scales = next(p for p in chunk_plan(SPEC, 5, False).parts if p.part == PART_SCALES)
    assert (scales.shape, scales.dtype, scales.layer_bytes) == ((2, 1), torch.float32, 4)
    tokens = np.arange(20, dtype="<u4")
    blob = encode_window(SPEC, tokens, make_streams(SPEC, 6, 1, ephemeral=True))
    assert len(blob) <= window_bytes_max(SPEC)
    check_window(SPEC, tokens, blob)


@pytest.mark.parametrize("zstd", [None, 3])
def test_chunks_round_trip_bit_exact_and_a_run_keeps_each_chunks_scale(zstd):
    counts = [8, 8, 3]
    ids = np.arange(sum(counts))
    parts = [make_streams(SPEC, n, seed) for seed, n in enumerate(counts)]
    bufs = [encode_chunk(SPEC, 8 * i, ids[8 * i:8 * i + n], data, zstd_level=zstd)
            for i, (n, data) in enumerate(zip(counts, parts, strict=True))]
    for buf, data in zip(bufs, parts, strict=True):
        assert_same(decode_chunk(buf, SPEC).streams, data)
    run = decode_chunks(bufs, SPEC, ids, counts)
    assert run["k8"].scales.shape == (2, 3) and run["k8"].codes.dtype == torch.float8_e4m3fn
    assert torch.equal(run["k8"].scales, torch.cat([p["k8"].scales for p in parts], 1))
    assert run["h"].codes.dtype == torch.float16 and run["h"].scales is None
    # each entry dequantizes with its own chunk's scale
    values = decode_values(FP8, run["k8"], SPEC.chunk_tokens)
    for i, data in enumerate(parts):
        want = data["k8"].codes.float() * data["k8"].scales.reshape(2, 1, 1, 1)
        torch.testing.assert_close(values[:, 8 * i:8 * i + counts[i]], want, equal_nan=True)
    one = decode_chunk(bufs[0], SPEC, streams=["k8"], layers=[1]).streams["k8"]
    assert torch.equal(one.scales, parts[0]["k8"].scales[1:])


def test_fp16_and_bf16_pass_through_exactly():
    x = torch.randn(3, 5, 3, 4, dtype=torch.float64).to(torch.float16)
    x[0, 0, 0, :3] = torch.tensor([1 + 2**-10, 65504.0, 2**-24])  # bf16 has none of these
    data = encode_values(FP16, x)
    assert data.codes.dtype == torch.float16 and torch.equal(data.codes, x)
    assert torch.equal(decode_values(FP16, data), x.float())
    y = torch.randn(1, 5, 4).to(torch.bfloat16)
    assert torch.equal(decode_values(BF16, encode_values(BF16, y)), y.float())


@pytest.mark.parametrize("scale", [None, 0.01, [0.02, 0.5]])
def test_fp8_dequantizes_within_e4m3s_error(scale):
    x = torch.randn(2, 40, 2, 4, generator=torch.Generator().manual_seed(3)) * 2
    data = encode_values(FP8, x, scale)
    assert data.codes.dtype == torch.float8_e4m3fn and data.scales.shape == (2, 1)
    s = data.scales.reshape(2, 1, 1, 1)
    if scale is not None:
        assert torch.equal(data.scales.reshape(-1), torch.tensor(scale).expand(2).float())
    # 3 mantissa bits: half a step is 2^-4 of the value; subnormals step by 2^-9 of s;
    # beyond 448 * s the code saturates
    want = x.clamp(-FP8_MAX * s, FP8_MAX * s)
    err = (decode_values(FP8, data) - want).abs()
    assert (err <= torch.maximum(want.abs() * 2**-4, s * 2**-10) * 1.0001).all()
    assert err.max() > 0  # really quantized
    if scale is None:  # computed: each layer's absmax maps to 448
        assert torch.equal(data.codes.float().abs().reshape(2, -1).amax(-1),
                           torch.full((2,), FP8_MAX))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_fp8_scale_is_refused_on_encode(bad):
    x = torch.ones(2, 8, 2, 4)
    with pytest.raises(InvalidRequest, match="finite and > 0"):
        encode_values(FP8, x, bad)
    data = make_streams(SPEC, 8)
    data["k8"] = StreamData(data["k8"].codes, torch.tensor([[1.0], [bad]]))
    with pytest.raises(InvalidRequest, match="finite and > 0"):
        encode_chunk(SPEC, 0, np.arange(8), data)


def test_fp8_encode_refuses_non_finite_values_and_a_wrong_scale_count():
    with pytest.raises(InvalidRequest, match="finite"):
        encode_values(FP8, torch.full((2, 1, 2, 4), float("nan")))
    with pytest.raises(InvalidRequest, match="one per layer"):
        encode_values(FP8, torch.ones(2, 1, 2, 4), [1.0, 2.0, 3.0])
    with pytest.raises(InvalidRequest, match="only fp8"):
        encode_values(FP16, torch.ones(3, 1, 3, 4), 1.0)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("-inf")])
def test_a_chunk_with_a_bad_fp8_scale_is_corrupt_on_every_read_path(bad):
    ids = np.arange(8)
    good = encode_chunk(SPEC, 0, ids, make_streams(SPEC, 8))
    assert resealed(good, SPEC, 1.25) != good
    verify_chunk(resealed(good, SPEC, 1.25), SPEC)  # the resealing itself is sound
    buf = resealed(good, SPEC, bad)
    for read in (lambda: verify_chunk(buf, SPEC), lambda: decode_chunk(buf, SPEC),
                 lambda: decode_chunk(buf, SPEC, streams=["h"]),
                 lambda: decode_chunks([buf], SPEC, ids, [8])):
        with pytest.raises(ChunkCorrupt, match="finite and > 0"):
            read()


@pytest.mark.parametrize("stream,codes,scales", [
    ("h", torch.zeros(3, 8, 3, 4, dtype=torch.bfloat16), None),  # fp16 stream, bf16 codes
    ("h", torch.zeros(3, 8, 3, 4, dtype=torch.float16), torch.ones(3, 8, 1).half()),
    ("k8", torch.zeros(2, 8, 2, 4, dtype=torch.int8), torch.ones(2, 1)),
    ("k8", torch.zeros(2, 8, 2, 4, dtype=torch.float8_e4m3fn), torch.ones(2, 1).half()),
    ("k8", torch.zeros(2, 8, 2, 4, dtype=torch.float8_e4m3fn), torch.ones(2, 8, 1)),
    ("k8", torch.zeros(2, 8, 2, 4, dtype=torch.float8_e4m3fn), None),
])
def test_a_wrong_dtype_or_shape_is_refused_on_encode(stream, codes, scales):
    data = make_streams(SPEC, 8)
    data[stream] = StreamData(codes, scales)
    with pytest.raises(LayoutMismatch):
        encode_chunk(SPEC, 0, np.arange(8), data)


def test_decode_values_checks_dtype_shape_and_scales():
    codes = torch.zeros(2, 3, 2, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(InvalidRequest, match="codes"):
        decode_values(FP8, StreamData(codes.view(torch.int8), torch.ones(2, 1)))
    with pytest.raises(InvalidRequest, match="chunk_tokens"):  # two chunks need it
        decode_values(FP8, StreamData(codes, torch.ones(2, 2)))
    with pytest.raises(InvalidRequest, match="finite and > 0"):
        decode_values(FP8, StreamData(codes, torch.zeros(2, 1)))
    with pytest.raises(InvalidRequest, match="codes"):
        decode_values(FP16, StreamData(torch.zeros(3, 1, 3, 4, dtype=torch.bfloat16), None))


def test_a_session_encodes_one_scale_for_every_chunk_or_one_per_chunk():
    tokens = np.arange(19, dtype="<u4")
    spec = LayoutSpec("fp8-only", (FP8,), chunk_tokens=8)
    x = torch.randn(2, 19, 2, 4)
    data = encode_values(FP8, x)
    for scales in (data.scales, torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]])):
        encoded = encode_session(spec, tokens, {"k8": StreamData(data.codes, scales)},
                                 scope="t")
        chunks = [encoded.chunks[i] for i in range(len(encoded.keys))]
        got = decode_persistent(spec, tokens, chunks, encoded.tail)["k8"]
        assert torch.equal(got.codes.view(torch.uint8), data.codes.view(torch.uint8))
        assert torch.equal(got.scales, scales.expand(2, 3))
    with pytest.raises(LayoutMismatch, match=r"\(layers, 3\)"):
        encode_session(spec, tokens, {"k8": StreamData(data.codes, torch.ones(2, 2))},
                       scope="t")


def restore_sections(spec: LayoutSpec, bufs: list[bytes]):
    """A layer-by-layer restore of ``bufs`` (the last one the tail): its header, and its
    LayerSection messages in the order the server sends them."""
    tokens = np.arange(sum(read_header(b).num_tokens for b in bufs), dtype=np.uint32)
    header = pb.SessionHeader(token_ids=tokens.astype("<u4").tobytes(),
                              chunk_tables=[chunk_table(b) for b in bufs],
                              chunk_digests=[chunk_digest(b) for b in bufs[:-1]],
                              tail_digest=chunk_digest(bufs[-1]))
    out = []
    for index, name, layer, chunk_index in section_order(spec, len(bufs)):
        buf = bufs[chunk_index]
        h = read_header(buf)
        payload = buf[h.payload_offset:]
        parts = {(r["stream"], r["layer"], r["part"]): (int(r["offset"]), int(r["length"]),
                                                      int(r["checksum"])) for r in h.sections}
        cut = []
        for part in (0, 1):
            offset, length, checksum = parts.get((index, layer, part), (0, 0, EMPTY_XXH3))
            cut.append((payload[offset:offset + length], checksum))
        (codes, codes_sum), (scales, scales_sum) = cut
        out.append(pb.LayerSection(stream=name, layer=layer, chunk_index=chunk_index,
                                   codes=codes, scales=scales, codes_xxh3=codes_sum,
                                   scales_xxh3=scales_sum))
    return header, out


def assembled(spec: LayoutSpec, bufs: list[bytes]) -> dict[tuple[str, int], object]:
    header, sections = restore_sections(spec, bufs)
    assembler = LayerAssembler.for_header(spec, header)
    slices = [assembler.add(s) for s in sections] + [assembler.finish()]
    return {(x.stream, x.layer): x.data for x in slices if x is not None}


def test_the_layer_assembler_gives_an_fp8_layer_its_chunks_scales_and_checks_them():
    bufs = [encode_chunk(SPEC, 8 * i, np.arange(8 * i, 8 * i + n), make_streams(SPEC, n, i))
            for i, n in enumerate([8, 2])]
    got = assembled(SPEC, bufs)[("k8", 1)]
    want = decode_chunks(bufs, SPEC, np.arange(10), [8, 2])["k8"]
    assert torch.equal(got.codes.view(torch.uint8), want.codes[1].view(torch.uint8))
    assert torch.equal(got.scales, want.scales[1])  # (chunks,) float32
    # A hostile writer's zero scale, every checksum and digest agreeing with it.
    with pytest.raises(ChunkCorrupt, match="finite and > 0"):
        assembled(SPEC, [resealed(bufs[0], SPEC, 0.0), bufs[1]])
