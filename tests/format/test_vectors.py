"""The codec, the keys and the error table against the committed golden vectors of
docs/wire-format.md (tests/vectors/*.json): the exact bytes another implementation must
produce. A change that alters one byte fails here; regenerate the vectors
(``python -m tests.vectors.generate``) only for a deliberate format change."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
import zstandard

from kernels.reference import dequantize_int4, dequantize_int8
from kvstore.format.chunk import decode_chunk, encode_chunk, read_header, split_chunks, verify_chunk
from kvstore.format.errors import (
    CLASS_FOR_STATUS,
    ERROR_CLASSES,
    ERROR_KEY,
    ChunkCorrupt,
    status_name,
)
from kvstore.format.keys import chain_keys, chunk_digest, token_bytes
from kvstore.format.layout import layout_from_json, layout_to_json
from kvtier.codec import decode_persistent, decode_window
from proto import kvtier_pb2 as pb
from tests.vectors.generate import header_fields, other_layout, stream_data, wire_layout

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
SPEC = wire_layout()


def load(name: str) -> dict:
    return json.loads((VECTORS / name).read_text())


CHUNKS = load("chunks.json")
PLAIN = [*CHUNKS["chunks"], CHUNKS["tail"], *CHUNKS["window"]["parts"]]


def streams_of(vector: dict) -> dict:
    return {name: stream_data(SPEC.stream(name), inputs)
            for name, inputs in vector["inputs"].items()}


def assert_inputs(decoded: dict, inputs: dict) -> None:
    """Decoded tensors hold exactly the vector's inputs (codes compared packed)."""
    want = {name: stream_data(SPEC.stream(name), v) for name, v in inputs.items()}
    assert set(decoded) == set(want)
    for name, data in want.items():
        assert torch.equal(decoded[name].codes, data.codes), name
        if data.scales is None:
            assert decoded[name].scales is None
        else:
            assert torch.equal(decoded[name].scales, data.scales), name


@pytest.mark.parametrize("spec", [SPEC, other_layout()], ids=lambda s: s.name)
def test_layout_canonical_json_and_id(spec):
    vector = next(v for v in load("layouts.json")["layouts"]
                  if v["layout_id"].startswith(spec.name + "@"))
    assert layout_to_json(spec) == vector["layout_json"]
    assert spec.layout_id == vector["layout_id"]
    assert f"{spec.layout_hash:016x}" == vector["layout_hash"]
    # the id is the hash of the canonical JSON without replayer, not of anything Python
    assert xxhash.xxh3_64_intdigest(vector["hashed_json"].encode()) == spec.layout_hash
    assert layout_from_json(vector["layout_json"]) == spec
    spaced = json.dumps(json.loads(vector["layout_json"]), indent=2)  # any JSON encoding
    assert layout_to_json(layout_from_json(spaced)) == vector["layout_json"]


def test_layout_id_and_token_bytes():
    assert SPEC.layout_id == CHUNKS["layout_id"]
    assert layout_from_json(json.dumps(CHUNKS["layout"])) == SPEC
    assert token_bytes(CHUNKS["token_ids"]).hex() == CHUNKS["token_bytes"]
    assert np.frombuffer(bytes.fromhex(CHUNKS["token_bytes"]), "<u4").tolist() == \
        CHUNKS["token_ids"]


@pytest.mark.parametrize("vector", PLAIN, ids=[v["name"] for v in PLAIN])
def test_uncompressed_chunks_are_byte_exact(vector):
    buf = encode_chunk(SPEC, vector["start_token"], vector["token_ids"], streams_of(vector),
                       ephemeral=vector["ephemeral"])
    assert buf.hex() == vector["bytes"]
    assert header_fields(buf) == vector["header"]
    assert chunk_digest(buf).hex() == vector["digest"]
    raw = bytes.fromhex(vector["bytes"])
    decoded = decode_chunk(raw, SPEC, token_ids=vector["token_ids"])
    assert_inputs(decoded.streams, vector["inputs"])


def test_header_and_section_checksums_are_xxh3_of_the_stated_bytes():
    vector = CHUNKS["chunks"][0]
    raw, header = bytes.fromhex(vector["bytes"]), vector["header"]
    payload = raw[header["payload_offset"]:]
    assert int(header["payload_checksum"], 16) == xxhash.xxh3_64_intdigest(payload)
    assert int(header["tokens_hash"], 16) == xxhash.xxh3_64_intdigest(
        token_bytes(vector["token_ids"]))
    for s in header["sections"]:
        section = payload[s["offset"]:s["offset"] + s["length"]]
        assert xxhash.xxh3_64_intdigest(section) == int(s["checksum"], 16)
    assert hashlib.blake2b(raw, digest_size=32, person=b"kvtier-bytes-v1").hexdigest() == \
        vector["digest"]
    flipped = bytearray(raw)
    flipped[-1] ^= 1
    with pytest.raises(ChunkCorrupt):
        verify_chunk(bytes(flipped), SPEC)


def test_zstd_chunk_decodes_to_the_same_payload():
    vector = CHUNKS["chunks_zstd"][0]
    plain = CHUNKS["chunks"][0]
    raw = bytes.fromhex(vector["bytes"])
    offset = vector["header"]["payload_offset"]
    # one frame declaring its content size; the header's checksum covers the frame
    assert zstandard.frame_content_size(raw[offset:]) == vector["header"]["raw_payload_len"]
    assert bytes.fromhex(vector["raw_payload"]) == bytes.fromhex(plain["bytes"])[offset:]
    decoded = decode_chunk(raw, SPEC, token_ids=vector["token_ids"])
    assert_inputs(decoded.streams, vector["inputs"])
    # this build's zstd may frame differently; what it writes must decode to the same
    again = encode_chunk(SPEC, 0, vector["token_ids"], streams_of(vector),
                         zstd_level=vector["zstd_level"])
    fields = header_fields(again)
    for changes_with_frame in ("stored_payload_len", "payload_checksum", "header_check"):
        fields.pop(changes_with_frame)
        vector["header"].pop(changes_with_frame)
    assert fields == vector["header"]
    assert read_header(again).flags == 1


def test_session_decodes_from_chunks_and_tail():
    tokens = np.array(CHUNKS["token_ids"], "<u4")
    chunks = [bytes.fromhex(c["bytes"]) for c in CHUNKS["chunks"]]
    tail = bytes.fromhex(CHUNKS["tail"]["bytes"])
    persistent = decode_persistent(SPEC, tokens, chunks, tail)
    assert_inputs(persistent, CHUNKS["session_inputs"])
    for name, values in CHUNKS["dequantized"].items():
        stream, data = SPEC.stream(name), persistent[name]
        dequant = dequantize_int4 if stream.bits == 4 else dequantize_int8
        got = dequant(data.codes, data.scales.reshape(*data.codes.shape[:-1], -1)
                      if stream.bits == 4 else data.scales, stream.group_size)
        assert got.reshape(-1).tolist() == values, name


def test_window_blob_is_its_chunks_back_to_back():
    window = CHUNKS["window"]
    blob = bytes.fromhex(window["bytes"])
    assert [bytes(p).hex() for p in split_chunks(blob)] == [p["bytes"] for p in window["parts"]]
    assert chunk_digest(blob).hex() == window["digest"]
    streams, start = decode_window(SPEC, np.array(CHUNKS["token_ids"], "<u4"), blob)
    assert start == window["parts"][0]["start_token"]
    assert_inputs(streams, {k: v for p in window["parts"] for k, v in p["inputs"].items()})


def test_chunk_keys():
    keys = load("keys.json")
    assert keys["layout_id"] == SPEC.layout_id
    for case in keys["cases"]:
        assert chain_keys(keys["layout_id"], case["token_ids"], case["chunk_tokens"],
                          scope=case["scope"], model_fingerprint=case["model_fingerprint"]
                          ) == case["chain_keys"]
    # the first key of case 1 is BLAKE2b-128 of the stated bytes, person zero-padded
    person = bytes.fromhex(keys["personalization"]["chunk_key"])
    digest = hashlib.blake2b(bytes.fromhex(keys["first_key_input"]), digest_size=16,
                             person=person).hexdigest()
    assert digest == keys["cases"][1]["chain_keys"][0]


def test_error_table():
    errors = load("errors.json")
    assert errors["trailer_key"] == ERROR_KEY
    assert set(errors["classes"]) == set(ERROR_CLASSES)
    for name, status in errors["classes"].items():
        cls = ERROR_CLASSES[name]
        assert status_name(cls(()) if name == "ChunksNotHeld" else cls("")) == status
    assert {s: c.__name__ for s, c in CLASS_FOR_STATUS.items()} == \
        errors["class_without_trailer"]
    # the spec's table names every class a trailer can carry, with its status
    spec = (VECTORS.parents[1] / "docs" / "wire-format.md").read_text()
    table = spec[spec.index("| `kvtier-error` | status |"):spec.index("Without a trailer:")]
    rows = {}
    for line in [row for row in table.splitlines() if row.startswith("|")][2:]:
        names, status = line.strip("| ").rsplit("|", 1)
        rows.update(dict.fromkeys(re.findall(r"`(\w+)`", names), status.strip()))
    assert {n: s for n, s in rows.items() if n in ERROR_CLASSES} == errors["classes"]


def test_prefix_chunk_messages():
    vectors = load("prefix_chunks.json")
    assert vectors["layout_id"] == SPEC.layout_id
    for chunk in vectors["chunks"]:
        buf = encode_chunk(SPEC, chunk["start_token"], chunk["token_ids"], streams_of(chunk))
        assert buf.hex() == chunk["bytes"] and chunk_digest(buf).hex() == chunk["digest"]
    for case in vectors["cases"]:
        keys = chain_keys(SPEC.layout_id, case["token_ids"], vectors["chunk_tokens"],
                          scope=case["scope"], model_fingerprint=case["model_fingerprint"])
        first = case["write_header"]["first_chunk"]
        assert keys[first:] == case["reply_chunk_keys"] == case["payload_keys"]
        header = pb.WriteChunksHeader.FromString(bytes.fromhex(case["write_header"]["bytes"]))
        assert header.token_ids == token_bytes(case["token_ids"])
        assert header.first_chunk == first and header.ack == pb.ACK_DURABLE
        assert [d.hex() for d in header.chunk_digests] == \
            case["write_header"]["chunk_digests"] == [c["digest"] for c in vectors["chunks"]]
        assert (header.tenant, header.dedupe_domain, header.model_fingerprint) == \
            (case["tenant"], case["dedupe_domain"], case["model_fingerprint"])
        read = pb.ReadChunksRequest.FromString(bytes.fromhex(case["read_request"]["bytes"]))
        start = read.first_chunk
        assert keys[start:start + read.max_chunks] == case["read_chunk_keys"]
    # the two scopes chain apart: no domain's keys name another's chunks
    own, shared = vectors["cases"]
    assert not set(own["reply_chunk_keys"]) & set(shared["reply_chunk_keys"])
