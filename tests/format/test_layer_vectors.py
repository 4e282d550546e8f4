"""tests/vectors/layers.json: a layer-by-layer Restore of the chunks.json session, as
docs/wire-format.md section 6 orders and checks it (``kvstore.format.layer_sections``),
and the pending rows' token counts of section 3."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.format.checks import check_part, pending_counts
from kvstore.format.chunk import read_header
from kvstore.format.errors import ChunkCorrupt, DataLoss, InvalidRequest
from kvstore.format.layer_sections import LayerCheck
from kvstore.format.window import encode_window
from tests.vectors.generate import layers_vector, stream_data, wire_layout

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
SPEC = wire_layout()
CHUNKS = json.loads((VECTORS / "chunks.json").read_text())
LAYERS = json.loads((VECTORS / "layers.json").read_text())
BLOCKS = [bytes.fromhex(CHUNKS["chunks"][0]["bytes"]), bytes.fromhex(CHUNKS["tail"]["bytes"])]
TOKENS = np.array(CHUNKS["token_ids"], "<u4")


def sections(vector: dict) -> list[tuple]:
    return [(s["stream"], s["layer"], s["chunk_index"], bytes.fromhex(s["codes"]),
             bytes.fromhex(s["scales"]), int(s["codes_xxh3"], 16), int(s["scales_xxh3"], 16))
            for s in vector["sections"]]


def checker(tables=None, digests=None) -> LayerCheck:
    tables = [bytes.fromhex(t) for t in LAYERS["chunk_tables"]] if tables is None else tables
    digests = digests or [bytes.fromhex(CHUNKS["chunks"][0]["digest"]),
                          bytes.fromhex(CHUNKS["tail"]["digest"])]
    return LayerCheck(SPEC, TOKENS, tables, digests[:1], digests[1])


def test_the_vector_is_what_the_codec_gives():
    assert layers_vector(SPEC, BLOCKS) == LAYERS
    assert [bytes.fromhex(t) for t in LAYERS["chunk_tables"]] == \
        [b[:read_header(b).payload_offset] for b in BLOCKS]


def test_order_tail_sections_and_checksums():
    got = [(s["stream"], s["layer"], s["chunk_index"]) for s in LAYERS["sections"]]
    # layer 0 of every stream (chunk 0, then the tail as chunk 1) before a.int4's layer 1
    assert got == [("a.int4", 0, 0), ("a.int4", 0, 1), ("b.int8", 0, 0), ("b.int8", 0, 1),
                   ("c.bf16", 0, 0), ("c.bf16", 0, 1), ("a.int4", 1, 0), ("a.int4", 1, 1)]
    assert LAYERS["empty_xxh3"] == f"{xxhash.xxh3_64_intdigest(b''):016x}" == \
        "2d06800538d394c2"
    for stream, _, _, codes, scales, codes_sum, scales_sum in sections(LAYERS):
        assert codes_sum == xxhash.xxh3_64_intdigest(codes)
        assert scales_sum == xxhash.xxh3_64_intdigest(scales)
        if stream == "c.bf16":  # no scales part: the checksum of no bytes, not 0
            assert scales == b"" and scales_sum == int(LAYERS["empty_xxh3"], 16)


def test_the_check_accepts_the_vector_and_refuses_any_change():
    check = checker()
    for section in sections(LAYERS):
        check.add(*section)
    check.finish()
    listed = sections(LAYERS)
    with pytest.raises(ChunkCorrupt, match="out of order"):
        check = checker()
        for section in [listed[1], listed[0], *listed[2:]]:
            check.add(*section)
    check = checker()
    for section in listed[:-1]:
        check.add(*section)
    with pytest.raises(ChunkCorrupt, match="ended before"):
        check.finish()
    stream, layer, chunk, codes, scales, codes_sum, scales_sum = listed[0]
    flipped = bytes([codes[0] ^ 1]) + codes[1:]
    with pytest.raises(ChunkCorrupt, match="not the bytes"):
        checker().add(stream, layer, chunk, flipped, scales, xxhash.xxh3_64_intdigest(flipped),
                      scales_sum)
    with pytest.raises(ChunkCorrupt, match="not the bytes"):  # a bf16 scales_xxh3 of 0
        check = checker()
        for s in listed[:4]:
            check.add(*s)
        check.add(*listed[4][:6], 0)
    table = bytearray.fromhex(LAYERS["chunk_tables"][1])
    table[20] ^= 1  # the tail's token count
    with pytest.raises(ChunkCorrupt):
        checker(tables=[bytes.fromhex(LAYERS["chunk_tables"][0]), bytes(table)])
    check = checker(digests=[bytes(32), bytes.fromhex(CHUNKS["tail"]["digest"])])
    for section in listed:
        check.add(*section)
    with pytest.raises(DataLoss, match="chunk 0"):
        check.finish()


def test_pending_rows_are_n_mod_m():
    assert LAYERS["pending_rows"] == [{"num_tokens": n, "counts": [] if n % 2 == 0 else [1]}
                                      for n in range(4, 9)]
    part = bytes.fromhex(CHUNKS["window"]["parts"][1]["bytes"])
    header = read_header(part)
    assert header.num_tokens == 1 and header.start_token == 6
    check_part(SPEC, 7, header)
    with pytest.raises(InvalidRequest, match="pending rows"):
        check_part(SPEC, 8, header)  # 8 tokens at m = 2: none pending, and not at the end
    pending = {"p.pending": stream_data(SPEC.stream("p.pending"),
                                        CHUNKS["window"]["parts"][1]["inputs"]["p.pending"])}
    with pytest.raises(InvalidRequest, match="pending rows"):
        encode_window(SPEC, np.arange(8, dtype="<u4"), pending)
    assert pending_counts(SPEC, 7) == {1}
