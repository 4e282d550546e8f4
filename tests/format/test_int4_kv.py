"""The engines' int4 K/V (vLLM value_format int4, transformers bits=4) against its golden
vector (tests/vectors/int4_kv.json, docs/wire-format.md "int4 K/V of an engine"): float
K/V through kvtier's quantizer give the committed code bytes, fp16 scales and chunk bytes;
the round trip keeps the stated error bound; damaged or misshapen bytes are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.format.chunk import StreamData, decode_chunk, encode_chunk
from kvstore.format.errors import ChunkCorrupt, CodecError, InvalidRequest, LayoutMismatch
from kvstore.format.hf.quant import decode_values, encode_values
from kvstore.format.keys import chunk_digest
from kvstore.format.layout import layout_from_json, layout_to_json
from tests.vectors.generate import header_fields, int4_kv_layout

VECTOR = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "int4_kv.json")
                    .read_text())
SPEC = int4_kv_layout()


def inputs(name: str) -> torch.Tensor:
    stream = VECTOR["streams"][name]
    return torch.tensor(stream["values"], dtype=torch.float32).reshape(stream["shape"])


def test_layout_json_and_id():
    assert layout_to_json(SPEC) == VECTOR["layout"]["layout_json"]
    assert SPEC.layout_id == VECTOR["layout"]["layout_id"]
    assert layout_from_json(VECTOR["layout"]["layout_json"]) == SPEC
    # 64 int4 values and two fp16 scales per head and token: 0.28x of bf16
    assert SPEC.persistent_bytes_per_token == 2 * 2 * (32 + 2 * 2)
    assert SPEC.persistent_bytes_per_token / (2 * 2 * 64 * 2) == pytest.approx(0.28125)


@pytest.mark.parametrize("name", ["k", "v"])
def test_the_quantizer_writes_the_committed_codes_and_scales(name):
    stream, want = SPEC.stream(name), VECTOR["streams"][name]
    data = encode_values(stream, inputs(name))
    assert data.codes.reshape(-1).tolist() == want["code_bytes"]
    assert data.scales.float().reshape(-1).tolist() == want["scales"]
    assert decode_values(stream, data).reshape(-1).tolist() == want["decoded"]
    # the vector's cases: a zero group, an outlier's group (8 / 7), a negative absmax
    # (-1.75 at scale 0.25 is code -7: nibble 9) and half steps rounded to even
    if name == "k":
        assert want["scales"][0] == 0.0 and want["code_bytes"][:16] == [0] * 16
        assert want["scales"][3] == float(np.float16(8 / 7))
        assert want["scales"][4] == 0.25
        first = want["code_bytes"][2 * 64 // 2]  # token 1, head 0: values 0 and 1
        assert (first & 15, first >> 4) == (9, 0)  # -1.75 -> -7, 0.125 -> 0 (half to even)
        assert want["code_bytes"][2 * 64 // 2 + 1] & 15 == 2  # 0.375 -> 1.5 -> 2


def test_the_chunk_bytes_and_what_a_reader_decodes():
    data = {name: encode_values(SPEC.stream(name), inputs(name)) for name in ("k", "v")}
    buf = encode_chunk(SPEC, 0, VECTOR["token_ids"], data)
    assert buf.hex() == VECTOR["chunk"]["bytes"]
    assert header_fields(buf) == VECTOR["chunk"]["header"]
    assert chunk_digest(buf).hex() == VECTOR["chunk"]["digest"]
    decoded = decode_chunk(buf, SPEC, token_ids=VECTOR["token_ids"]).streams
    for name in ("k", "v"):
        values = decode_values(SPEC.stream(name), decoded[name])
        assert values.reshape(-1).tolist() == VECTOR["streams"][name]["decoded"]
    # language-independent: the k codes are the first bytes of the payload, its fp16
    # scales (little-endian) follow them
    raw = bytes.fromhex(VECTOR["chunk"]["bytes"])[VECTOR["chunk"]["header"]["payload_offset"]:]
    codes = len(VECTOR["streams"]["k"]["code_bytes"])
    assert list(raw[:codes]) == VECTOR["streams"]["k"]["code_bytes"]
    scales = np.frombuffer(raw[codes:codes + 2 * len(VECTOR["streams"]["k"]["scales"])], "<f2")
    assert scales.astype(float).tolist() == VECTOR["streams"]["k"]["scales"]


def test_the_round_trip_keeps_half_a_step_per_group():
    """K with outlier channels and V of ordinary magnitudes, 1 to 3 orders apart: every
    value within half its group's step (scale / 2, plus float32's rounding of x / scale)."""
    gen = torch.Generator().manual_seed(3)
    stream = SPEC.stream("k")
    x = torch.randn(1, 512, 2, 64, generator=gen)
    x[..., 5] *= 30.0  # a key outlier channel
    x[:, ::7] *= 1e-3
    data = encode_values(stream, x)
    err = (decode_values(stream, data) - x).abs().reshape(1, 512, 4, 32)
    step = data.scales.float().reshape(1, 512, 4, 1)
    assert (err <= step / 2 * (1 + 2.0 ** -16) + 7 * 2.0 ** -24).all()
    assert err.max() > 0  # it is 4 bits, not a copy


def test_damaged_or_misshapen_bytes_are_refused():
    buf = bytearray.fromhex(VECTOR["chunk"]["bytes"])
    offset = VECTOR["chunk"]["header"]["payload_offset"]
    for at in (offset, offset + 70, len(buf) - 1):  # a code byte, a scale byte, the last
        damaged = bytearray(buf)
        damaged[at] ^= 0x10
        with pytest.raises(ChunkCorrupt):
            decode_chunk(bytes(damaged), SPEC, token_ids=VECTOR["token_ids"])
    with pytest.raises(CodecError):  # cut short: the layout says how long it is
        decode_chunk(bytes(buf[:-2]), SPEC, token_ids=VECTOR["token_ids"])
    with pytest.raises(LayoutMismatch, match="other token ids"):
        decode_chunk(bytes(buf), SPEC, token_ids=[5, 6])
    stream = SPEC.stream("k")
    good = encode_values(stream, inputs("k"))
    with pytest.raises(InvalidRequest, match="codes must be"):  # a head short
        decode_values(stream, StreamData(good.codes[:, :, :1].contiguous(), good.scales))
    with pytest.raises(InvalidRequest, match="codes must be"):  # codes not packed nibbles
        decode_values(stream, StreamData(good.codes.to(torch.int8), good.scales))
    with pytest.raises(InvalidRequest, match="not finite|range"):
        encode_values(stream, torch.full((1, 1, 2, 64), float("inf")))
