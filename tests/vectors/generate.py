"""Write the golden vectors of docs/wire-format.md: ``python -m tests.vectors.generate``.

The vectors are inputs and the exact bytes and keys kvtier produces for them (and the
WriteChunks / ReadChunks messages of ``prefix_chunks.json``), for a
small layout with one stream of each kind (int4, int8, bf16; a window stream and a
pending stream), (formats.json) one small layout and chunk per other value format
(fp16, fp8_e4m3, page), and (int4_kv.json) float K/V through kvtier's int4 quantizer
into a chunk of the engines' int4 K/V layout (vLLM value_format int4, transformers
bits=4). ``tests/format/test_vectors.py`` compares the codec against the committed
files, and the Node client (clients/node) against the same files, so a change to the codec
that alters a byte fails both: regenerate only for a deliberate format change.

Inputs are small integers and floats that fp16 / bf16 hold exactly, written out in full,
so another implementation can rebuild every tensor from the JSON alone.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import torch
import xxhash
import zstandard

from kernels.reference import pack_int4
from kvstore.format.checks import pending_counts
from kvstore.format.chunk import StreamData, encode_chunk, read_header
from kvstore.format.chunk_parts import code_dtype
from kvstore.format.errors import CLASS_FOR_STATUS, ERROR_CLASSES, ERROR_KEY, status_name
from kvstore.format.hf.quant import decode_values, encode_values
from kvstore.format.keys import chain_keys, chunk_digest, chunk_key, dedupe_scope, token_bytes
from kvstore.format.layer_sections import EMPTY_XXH3, chunk_table, section_order
from kvstore.format.layout import BaselineKV, LayoutSpec, Stream, layout_to_json
from kvtier.conformance.sessions import EVERY_KIND
from proto import kvtier_pb2 as pb

HERE = Path(__file__).resolve().parent
TENANT = "acme"
SHARED_DOMAIN = "public-prompts"
MODEL_FINGERPRINT = "wire-test-model@1"
# Seven tokens: one full chunk of four, a tail of three whose last token is pending (m = 2).
TOKENS = [1, 2, 3, 258, 65536, 999, 7]
ZSTD_LEVEL = 3


def wire_layout() -> LayoutSpec:
    """The vectors' layout: every kind of stream, a chunk of 4 tokens, W = 4."""
    return LayoutSpec("wire-test", EVERY_KIND, chunk_tokens=4, vocab_size=1 << 17,
                      window_tokens=4, notes="golden vectors of docs/wire-format.md")


def other_layout() -> LayoutSpec:
    """A second layout for the id vectors: the optional keys set (baseline, layer modes,
    a replayer, a required model fingerprint)."""
    return LayoutSpec(
        name="wire-test-full",
        streams=(
            Stream("latent", (64,), bits=4, group_size=32, tokens_per_entry=4, layers=2),
            Stream("window", (2, 16), bits=8, group_size=16, layers=3, persistent=False),
        ),
        chunk_tokens=64,
        baseline=BaselineKV(layers=3, kv_heads=2, head_dim=16),
        layer_modes=("full", "reuse", "full"),
        vocab_size=256,
        window_tokens=32,
        requires_model_fingerprint=True,
        replayer="bundled",
        notes="not encoded",
    )


def layout_vector(spec: LayoutSpec) -> dict:
    """The canonical JSON, the object hashed (the same without replayer) and the id."""
    canonical = layout_to_json(spec)
    hashed = json.loads(canonical)
    del hashed["replayer"]
    hashed_json = json.dumps(hashed, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert xxhash.xxh3_64_intdigest(hashed_json.encode()) == spec.layout_hash
    return {"layout_json": canonical, "hashed_json": hashed_json,
            "layout_hash": f"{spec.layout_hash:016x}", "layout_id": spec.layout_id}


def stream_values(stream: Stream, entries: int, seed: int) -> dict:
    """Readable inputs for one stream over ``entries`` entries: integer codes in the
    stream's range (unpacked, one per value) and fp16 scales; bf16 values for 16 bits."""
    shape = [stream.layers, entries, *stream.entry_shape]
    n = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    if stream.bits == 16:
        # multiples of 1/8 in [-4, 4): exact in bf16
        return {"shape": shape, "values": (rng.integers(-32, 32, n) / 8).tolist()}
    low, high = (-8, 8) if stream.bits == 4 else (-127, 128)  # int8 codes keep off -128
    codes = rng.integers(low, high, n)
    groups = n // stream.group_size
    scales = (rng.integers(1, 64, groups) / 64).tolist()  # exact in fp16
    return {"shape": shape, "values": codes.tolist(),
            "scales_shape": [stream.layers, entries, stream.scales_per_entry],
            "scales": scales}


def stream_data(stream: Stream, inputs: dict) -> StreamData:
    """The codec's tensors for one stream's inputs (see ``stream_values`` and
    ``format_values``)."""
    shape = inputs["shape"]
    if stream.value_format.scales == "none":  # bf16, fp16: the values, exact in the format
        codes = torch.tensor(inputs["values"], dtype=torch.float32).to(code_dtype(stream))
        return StreamData(codes.reshape(shape), None)
    if stream.value_format.scales == "tensor":  # fp8: codes are e4m3 values, exactly
        codes = torch.tensor(inputs["values"], dtype=torch.float32).to(code_dtype(stream))
        scales = torch.tensor(inputs["scales"], dtype=torch.float32)
        return StreamData(codes.reshape(shape), scales.reshape(inputs["scales_shape"]))
    values = torch.tensor(inputs["values"], dtype=torch.int8).reshape(shape)
    codes = pack_int4(values) if stream.bits == 4 else values
    assert codes.dtype == code_dtype(stream)
    scales = torch.tensor(inputs["scales"], dtype=torch.float16).reshape(inputs["scales_shape"])
    return StreamData(codes, scales)


def sliced(stream: Stream, inputs: dict, start: int, stop: int) -> dict:
    """The inputs of entries [start, stop) of a stream."""
    shape = inputs["shape"]
    values = np.array(inputs["values"]).reshape(shape)[:, start:stop]
    out = {"shape": list(values.shape), "values": values.reshape(-1).tolist()}
    if "scales" in inputs:
        scales = np.array(inputs["scales"]).reshape(inputs["scales_shape"])[:, start:stop]
        out |= {"scales_shape": list(scales.shape), "scales": scales.reshape(-1).tolist()}
    return out


def dequantized(stream: Stream, inputs: dict) -> list[float]:
    """value = code * scale of its group (float32), as a reader reconstructs it."""
    values = np.array(inputs["values"], np.float32).reshape(-1, stream.group_size)
    scales = np.array(inputs["scales"], np.float16).astype(np.float32).reshape(-1, 1)
    return (values * scales).reshape(-1).tolist()


def header_fields(buf: bytes) -> dict:
    h = read_header(buf)
    table_end = h.payload_offset - 8
    return {
        "version": h.version, "flags": h.flags, "layout_hash": f"{h.layout_hash:016x}",
        "start_token": h.start_token, "num_tokens": h.num_tokens,
        "section_count": len(h.sections), "tokens_hash": f"{h.tokens_hash:016x}",
        "stored_payload_len": h.stored_payload_len, "raw_payload_len": h.raw_payload_len,
        "payload_checksum": f"{h.payload_checksum:016x}",
        "header_check": f"{xxhash.xxh3_64_intdigest(buf[:table_end]):016x}",
        "payload_offset": h.payload_offset,
        "sections": [
            {"stream": s, "layer": layer, "part": p, "offset": o, "length": n,
             "checksum": f"{c:016x}"}
            for s, layer, p, _, o, n, c in h.sections.tolist()
        ],
    }


def chunk_vector(spec: LayoutSpec, name: str, start: int, tokens: list[int],
                 inputs: dict[str, dict], *, ephemeral: bool = False,
                 zstd_level: int | None = None) -> dict:
    streams = {n: stream_data(spec.stream(n), v) for n, v in inputs.items()}
    buf = encode_chunk(spec, start, tokens, streams, ephemeral=ephemeral, zstd_level=zstd_level)
    out = {"name": name, "start_token": start, "token_ids": tokens, "ephemeral": ephemeral,
           "zstd": zstd_level is not None, "inputs": inputs, "header": header_fields(buf),
           "digest": chunk_digest(buf).hex(), "bytes": buf.hex()}
    if zstd_level is not None:
        raw = zstandard.ZstdDecompressor().decompress(buf[out["header"]["payload_offset"]:])
        out["zstd_level"] = zstd_level
        out["raw_payload"] = raw.hex()
    return out


def build() -> dict[str, dict]:
    spec = wire_layout()
    n = len(TOKENS)
    full = {s.name: stream_values(s, s.entries_for(n), seed)
            for seed, s in enumerate(spec.persistent_streams)}
    size = spec.chunk_tokens

    def part(lo: int, hi: int) -> dict[str, dict]:
        return {s.name: sliced(s, full[s.name], lo // s.tokens_per_entry, s.entries_for(hi))
                for s in spec.persistent_streams}

    window_stream, pending_stream = spec.ephemeral_streams
    pending = n % spec.stream("a.int4").tokens_per_entry
    window_inputs = {window_stream.name: stream_values(window_stream, spec.window_tokens, 5)}
    pending_inputs = {pending_stream.name: stream_values(pending_stream, pending, 6)}
    w_start = n - spec.window_tokens
    window_parts = [
        chunk_vector(spec, "window K/V", w_start, TOKENS[w_start:], window_inputs,
                     ephemeral=True),
        chunk_vector(spec, "pending rows", n - pending, TOKENS[n - pending:], pending_inputs,
                     ephemeral=True),
    ]
    chunks = {
        "layout": json.loads(layout_to_json(spec)),
        "layout_id": spec.layout_id,
        "token_ids": TOKENS,
        "token_bytes": token_bytes(TOKENS).hex(),
        "session_inputs": full,
        "dequantized": {s.name: dequantized(s, full[s.name]) for s in spec.persistent_streams
                        if s.bits < 16},
        "chunks": [chunk_vector(spec, "chunk 0", 0, TOKENS[:size], part(0, size))],
        "chunks_zstd": [chunk_vector(spec, "chunk 0 (zstd)", 0, TOKENS[:size], part(0, size),
                                     zstd_level=ZSTD_LEVEL)],
        "tail": chunk_vector(spec, "tail", size, TOKENS[size:], part(size, n)),
        "window": {"parts": window_parts,
                   "bytes": "".join(p["bytes"] for p in window_parts),
                   "digest": chunk_digest(bytes.fromhex(
                       "".join(p["bytes"] for p in window_parts))).hex()},
    }
    keys = {
        "layout_id": spec.layout_id,
        "cases": [
            {"scope": dedupe_scope(TENANT), "tenant": TENANT, "dedupe_domain": "",
             "model_fingerprint": "", "chunk_tokens": size, "token_ids": TOKENS},
            {"scope": dedupe_scope(TENANT), "tenant": TENANT, "dedupe_domain": "",
             "model_fingerprint": MODEL_FINGERPRINT, "chunk_tokens": size,
             "token_ids": TOKENS + [4, 5, 6, 8, 9]},
            {"scope": dedupe_scope(TENANT, SHARED_DOMAIN), "tenant": TENANT,
             "dedupe_domain": SHARED_DOMAIN, "model_fingerprint": MODEL_FINGERPRINT,
             "chunk_tokens": size, "token_ids": TOKENS + [4, 5, 6, 8, 9]},
        ],
    }
    for case in keys["cases"]:
        case["chain_keys"] = chain_keys(spec.layout_id, case["token_ids"], size,
                                        scope=case["scope"],
                                        model_fingerprint=case["model_fingerprint"])
    first = keys["cases"][1]
    person = b"kvtier-chunk-v2"
    keys["first_key_input"] = (  # the bytes hashed for the first key of case 1
        b"".join(len(p.encode()).to_bytes(4, "little") + p.encode()
                 for p in (first["scope"], spec.layout_id, first["model_fingerprint"], ""))
        + token_bytes(first["token_ids"][:size])).hex()
    keys["personalization"] = {"chunk_key": person.ljust(16, b"\0").hex(),
                               "digest": b"kvtier-bytes-v1".ljust(16, b"\0").hex()}
    assert first["chain_keys"][0] == chunk_key(first["scope"], spec.layout_id,
                                               first["model_fingerprint"], "",
                                               first["token_ids"][:size])
    errors = {
        "trailer_key": ERROR_KEY,
        "classes": {name: status_name(cls("")) if name != "ChunksNotHeld" else
                    status_name(cls(())) for name, cls in ERROR_CLASSES.items()},
        "class_without_trailer": {status: cls.__name__ for status, cls in
                                  CLASS_FOR_STATUS.items()},
    }
    layouts = {"layouts": [layout_vector(spec), layout_vector(other_layout())]}
    blocks = [bytes.fromhex(chunks["chunks"][0]["bytes"]), bytes.fromhex(chunks["tail"]["bytes"])]
    return {"layouts.json": layouts, "chunks.json": chunks, "keys.json": keys,
            "errors.json": errors, "prefix_chunks.json": prefix_chunks(spec),
            "formats.json": build_formats(), "layers.json": layers_vector(spec, blocks),
            "int4_kv.json": build_int4_kv()}


def prefix_chunks(spec: LayoutSpec) -> dict:
    """WriteChunks and ReadChunks of a three-chunk sequence: the header a client sends
    for chunks 1 and 2 (first_chunk 1, chunk 0 written before), the chunk keys the server
    answers (chained from token 0 in the caller's scope), and a ReadChunks of chunk 1."""
    tokens = TOKENS + [4, 5, 6, 8, 9]
    size = spec.chunk_tokens
    full = {s.name: stream_values(s, s.entries_for(len(tokens)), 10 + seed)
            for seed, s in enumerate(spec.persistent_streams)}
    chunks = [chunk_vector(spec, f"chunk {i}", i * size, tokens[i * size:(i + 1) * size],
                           {s.name: sliced(s, full[s.name], i * size // s.tokens_per_entry,
                                           s.entries_for((i + 1) * size))
                            for s in spec.persistent_streams})
              for i in range(1, len(tokens) // size)]
    cases = []
    for domain in ("", SHARED_DOMAIN):
        scope = dedupe_scope(TENANT, domain or None)
        keys = chain_keys(spec.layout_id, tokens, size, scope=scope,
                          model_fingerprint=MODEL_FINGERPRINT)
        header = pb.WriteChunksHeader(
            tenant=TENANT, layout_id=spec.layout_id, model_fingerprint=MODEL_FINGERPRINT,
            dedupe_domain=domain, token_ids=token_bytes(tokens), first_chunk=1,
            chunk_digests=[bytes.fromhex(c["digest"]) for c in chunks], ack=pb.ACK_DURABLE)
        read = pb.ReadChunksRequest(
            tenant=TENANT, layout_id=spec.layout_id, model_fingerprint=MODEL_FINGERPRINT,
            dedupe_domain=domain, token_ids=token_bytes(tokens), first_chunk=1, max_chunks=1)
        cases.append({
            "scope": scope, "tenant": TENANT, "dedupe_domain": domain,
            "model_fingerprint": MODEL_FINGERPRINT, "token_ids": tokens,
            "write_header": {"first_chunk": 1, "chunk_digests": [c["digest"] for c in chunks],
                             "ack": "ACK_DURABLE", "bytes": header.SerializeToString().hex()},
            "payload_keys": keys[1:],  # Payload.key of each chunk sent
            "reply_chunk_keys": keys[1:],  # WriteChunksReply.chunk_keys
            "read_request": {"first_chunk": 1, "max_chunks": 1,
                             "bytes": read.SerializeToString().hex()},
            "read_chunk_keys": keys[1:2],  # ChunksHeader.chunk_keys
        })
    return {"layout_id": spec.layout_id, "chunk_tokens": size, "chunks": chunks,
            "cases": cases,
            "missing_reasons": ["not_held", "corrupt", "digest_mismatch", "tier_unavailable"],
            "refused": [{"token_ids": tokens[:-1], "why": "a partial last chunk",
                         "status": "INVALID_ARGUMENT"}]}


def format_layouts() -> list[LayoutSpec]:
    """One layout per format beyond int4 / int8 / bf16: a chunk of 4 tokens each."""
    return [
        LayoutSpec("wire-test-fp16", (Stream("h.fp16", (2, 4), bits=16, layers=2,
                                             format="fp16"),),
                   chunk_tokens=4, vocab_size=1 << 17),
        LayoutSpec("wire-test-fp8", (Stream("f.fp8", (2, 4), bits=8, layers=2,
                                            format="fp8_e4m3"),),
                   chunk_tokens=4, vocab_size=1 << 17),
        # an engine's page of 4 tokens per layer: 2 heads of 8 opaque bytes
        LayoutSpec("wire-test-page", (Stream("p.page", (2, 8), bits=8, layers=2,
                                             tokens_per_entry=4, format="page"),),
                   chunk_tokens=4, vocab_size=1 << 17),
    ]


def format_values(stream: Stream, entries: int, seed: int) -> dict:
    """Inputs of an fp16 stream (values fp16 holds exactly, some that bf16 does not), an
    fp8 one (e4m3 code values, their bytes, one float32 scale per layer) or a page one
    (the bytes themselves)."""
    shape = [stream.layers, entries, *stream.entry_shape]
    n = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    if stream.format == "fp16":
        values = (rng.integers(-4096, 4096, n) / 1024).astype(np.float16).astype(float)
        # 1 + 2^-10 (bf16 rounds it), fp16's largest, smallest normal and subnormal
        values[:4] = [1 + 2**-10, 65504.0, -(2**-14), 2**-24]
        return {"shape": shape, "values": values.tolist()}
    if stream.format == "page":
        return {"shape": shape, "values": rng.integers(0, 256, n).tolist()}
    codes = rng.integers(0, 256, n).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes (0x7f, 0xff): 1.0 instead
    codes[:2] = [0x7E, 0x01]  # e4m3's largest (448) and smallest subnormal (2^-9)
    values = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()
    return {"shape": shape, "values": values.tolist(), "code_bytes": codes.tolist(),
            "scales_shape": [stream.layers, 1],
            "scales": [0.015625, 0.375, 3.0][:stream.layers]}


def format_decoded(stream: Stream, inputs: dict) -> list[float] | None:
    """What a reader reconstructs, float32: fp16 the values; fp8 code x its layer's scale;
    page nothing (its bytes are copied, never decoded)."""
    if stream.format == "page":
        return None
    values = np.array(inputs["values"], np.float32)
    if stream.format == "fp16":
        return values.tolist()
    scales = np.array(inputs["scales"], np.float32).reshape(stream.layers, 1)
    return (values.reshape(stream.layers, -1) * scales).reshape(-1).tolist()


def build_formats() -> dict:
    """formats.json: per layout, its canonical JSON and id, and chunk 0 of a 4-token
    session with its inputs, exact bytes and decoded values."""
    tokens = TOKENS[:4]
    out = []
    for seed, spec in enumerate(format_layouts()):
        (stream,) = spec.streams
        inputs = {stream.name: format_values(stream, stream.entries_for(len(tokens)), seed)}
        chunk = chunk_vector(spec, f"{stream.format} chunk 0", 0, tokens, inputs)
        chunk["decoded"] = {stream.name: format_decoded(stream, inputs[stream.name])}
        out.append({"format": stream.format, "layout": layout_vector(spec), "chunk": chunk})
    return {"token_ids": tokens, "formats": out}


def int4_kv_layout() -> LayoutSpec:
    """The shape of an engine's int4 K/V layout (``vllm.layout.value_stream``,
    ``hf.model_layouts.standard_layout``): streams k and v of (kv_heads, head_dim) per
    token, one fp16 scale per token and 32 channels of a head."""
    return LayoutSpec("wire-test-int4-kv", tuple(
        Stream(name, (2, 64), bits=4, group_size=32, layers=1) for name in ("k", "v")),
        chunk_tokens=2, vocab_size=1 << 17)


def int4_kv_values(stream: Stream, seed: int) -> torch.Tensor:
    """(layers, 2 tokens, 2, 64) float32 K or V, exact in bf16 (multiples of 1/64 in
    [-2, 2)), with the cases a quantizer can get wrong: a group of zeros, a group with
    one outlier (the rest rounds to few codes), a group whose absmax is negative, and
    values on a half step (rounded to even)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, (stream.layers, 2, *stream.entry_shape)) / 64
    x[0, 0, 0, :32] = 0.0
    x[0, 0, 1, 32:] /= 16
    x[0, 0, 1, 40] = 8.0
    x[0, 1, 0, :32] = np.clip(x[0, 1, 0, :32], -1.0, 0.5)
    x[0, 1, 0, 0] = -1.75  # absmax negative: scale 0.25, code -7
    x[0, 1, 0, 1:3] = [0.125, 0.375]  # half steps of 0.25: codes 0 and 2 (to even)
    return torch.tensor(x, dtype=torch.float32)


def build_int4_kv() -> dict:
    """int4_kv.json: the layout, each stream's float inputs, the quantizer's code bytes
    and fp16 scales, chunk 0 of a 2-token session (exact bytes) and the decoded values."""
    spec = int4_kv_layout()
    tokens = TOKENS[:2]
    streams, data = {}, {}
    for seed, stream in enumerate(spec.streams):
        x = int4_kv_values(stream, 40 + seed)
        data[stream.name] = encode_values(stream, x)
        streams[stream.name] = {
            "shape": list(x.shape), "values": x.reshape(-1).tolist(),
            "code_bytes": data[stream.name].codes.reshape(-1).tolist(),
            "scales": data[stream.name].scales.float().reshape(-1).tolist(),
            "decoded": decode_values(stream, data[stream.name]).reshape(-1).tolist()}
    buf = encode_chunk(spec, 0, tokens, data)
    return {"layout": layout_vector(spec), "token_ids": tokens, "streams": streams,
            "chunk": {"header": header_fields(buf), "digest": chunk_digest(buf).hex(),
                      "bytes": buf.hex()}}


def layers_vector(spec: LayoutSpec, blocks: list[bytes]) -> dict:
    """A layer-by-layer Restore of the chunks.json session (chunk 0, then the tail as
    chunk_index 1): the header's chunk tables and every section, in order; and the
    pending rows' token counts of sessions of 4 to 8 tokens."""
    heads = [read_header(b) for b in blocks]
    sections = []
    for index, name, layer, chunk_index in section_order(spec, len(blocks)):
        rows = {(s, lay, p): (o, n, c) for s, lay, p, _, o, n, c in
                heads[chunk_index].sections.tolist()}
        raw = blocks[chunk_index][heads[chunk_index].payload_offset:]
        parts = []
        for part in (0, 1):
            offset, length, checksum = rows.get((index, layer, part), (0, 0, EMPTY_XXH3))
            parts.append((raw[offset:offset + length], checksum))
        (codes, codes_sum), (scales, scales_sum) = parts
        sections.append({"stream": name, "layer": layer, "chunk_index": chunk_index,
                         "codes": codes.hex(), "scales": scales.hex(),
                         "codes_xxh3": f"{codes_sum:016x}", "scales_xxh3": f"{scales_sum:016x}"})
    return {
        "chunk_tables": [chunk_table(b).hex() for b in blocks],
        "sections": sections,
        "empty_xxh3": f"{EMPTY_XXH3:016x}",
        "pending_rows": [{"num_tokens": n, "counts": sorted(pending_counts(spec, n))}
                         for n in range(4, 9)],
    }


def compact(text: str) -> str:
    """Lists of numbers on one line each, so a vector file reads as a table."""
    return re.sub(r"\[([-0-9.e,\s]+)\]",
                  lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for name, data in build().items():
        (out / name).write_text(compact(json.dumps(data, indent=1)) + "\n")
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
