"""The fp16, fp8_e4m3 and page formats against their committed golden vectors
(tests/vectors/formats.json, docs/wire-format.md "Value formats"): canonical JSON and
id, the exact chunk bytes, the inputs decoded back and the values a dequantizer gives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.format.chunk import decode_chunk, encode_chunk
from kvstore.format.errors import InvalidRequest
from kvstore.format.hf.quant import decode_values
from kvstore.format.keys import chunk_digest
from kvstore.format.layout import layout_from_json, layout_to_json
from tests.vectors.generate import format_layouts, header_fields, stream_data

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "formats.json")
                     .read_text())
CASES = {case["format"]: case for case in VECTORS["formats"]}
SPECS = {spec.streams[0].format: spec for spec in format_layouts()}


def test_every_new_format_has_a_vector():
    assert set(CASES) == set(SPECS) == {"fp16", "fp8_e4m3", "page"}


@pytest.mark.parametrize("fmt", sorted(SPECS))
def test_layout_json_and_id(fmt):
    spec, vector = SPECS[fmt], CASES[fmt]["layout"]
    assert layout_to_json(spec) == vector["layout_json"]
    assert f'"format":"{fmt}"' in vector["layout_json"]
    assert spec.layout_id == vector["layout_id"]
    assert layout_from_json(vector["layout_json"]) == spec


@pytest.mark.parametrize("fmt", sorted(SPECS))
def test_chunk_bytes_inputs_and_decoded_values(fmt):
    spec, vector = SPECS[fmt], CASES[fmt]["chunk"]
    (stream,) = spec.streams
    inputs = vector["inputs"]
    data = {name: stream_data(stream, v) for name, v in inputs.items()}
    buf = encode_chunk(spec, vector["start_token"], vector["token_ids"], data)
    assert buf.hex() == vector["bytes"]
    assert header_fields(buf) == vector["header"]
    assert chunk_digest(buf).hex() == vector["digest"]
    decoded = decode_chunk(bytes.fromhex(vector["bytes"]), spec,
                           token_ids=vector["token_ids"]).streams[stream.name]
    want = data[stream.name]
    assert torch.equal(decoded.codes.view(torch.uint8), want.codes.view(torch.uint8))
    if fmt == "page":  # opaque bytes: copied, never decoded
        assert vector["decoded"][stream.name] is None
        with pytest.raises(InvalidRequest, match="page bytes"):
            decode_values(stream, decoded)
    else:
        values = decode_values(stream, decoded)
        assert values.reshape(-1).tolist() == vector["decoded"][stream.name]
    # the vector states nothing Python-specific: the codes are the inputs' own bytes
    raw = np.frombuffer(bytes.fromhex(vector["bytes"]), np.uint8)
    offset = vector["header"]["payload_offset"]
    codes_bytes = sum(s["length"] for s in vector["header"]["sections"] if s["part"] == 0)
    codes = raw[offset:offset + codes_bytes]
    if fmt == "page":
        assert codes.tolist() == inputs[stream.name]["values"]
        assert vector["header"]["sections"][-1]["part"] == 0  # no scales part
    elif fmt == "fp16":
        assert codes.view("<f2").astype(float).tolist() == inputs[stream.name]["values"]
        assert torch.tensor(inputs[stream.name]["values"][:1]).to(torch.bfloat16).item() != \
            inputs[stream.name]["values"][0]  # bf16 could not have held it
    else:
        assert codes.tolist() == inputs[stream.name]["code_bytes"]
        scales = raw[offset + len(codes):].view("<f4").tolist()
        assert scales == inputs[stream.name]["scales"]
