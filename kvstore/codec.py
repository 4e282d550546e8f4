"""The on-media format of one chunk: a session's KV for a token range, all streams.

Layout of a chunk (little-endian)::

    header    magic "KVTC", version, flags, layout hash, start token, token count,
              section count, xxh3 of the token ids, stored and raw payload lengths
    sections  one entry per (stream, layer, part): stream index, layer, part (codes or
              scales), offset and length in the raw payload, xxh3-64 of the section bytes
    check     xxh3-64 of header + section table
    payload   the sections back to back, zstd-compressed as a whole when flagged

Codes are int4 packed two per byte (uint8), int8, or bf16; scales are fp16, one per group.
The header checksum covers the section table, and the table holds each section's checksum,
so every byte is covered while a reader of one layer verifies only what it reads.
Anything that does not check out raises a ``CodecError`` subclass: never a wrong tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
import zstandard

from kvstore.errors import ChunkCorrupt, ChunkTruncated, LayoutMismatch, UnsupportedVersion
from kvstore.keys import token_bytes
from kvstore.layout import LayoutSpec, Stream

MAGIC = b"KVTC"
VERSION = 1
FLAG_ZSTD = 1
FLAG_EPHEMERAL = 2
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_EPHEMERAL
PART_CODES, PART_SCALES = 0, 1

_HEADER = struct.Struct("<4sHHQQIIQQQ")
_SECTION = struct.Struct("<HHB3xQQQ")
_CHECK = struct.Struct("<Q")
# Bounds a corrupt header can claim, so decoding never tries to allocate absurd sizes.
MAX_SECTIONS = 1 << 16
MAX_PAYLOAD = 1 << 34

_CODE_DTYPES = {4: torch.uint8, 8: torch.int8, 16: torch.bfloat16}


@dataclass(frozen=True)
class StreamData:
    """One stream's share of a chunk, every owning layer."""

    codes: torch.Tensor  # (layers, entries, *codes_shape) uint8 (int4 packed) | int8 | bf16
    scales: torch.Tensor | None  # (layers, entries, scales_per_entry) float16; None for bf16


@dataclass(frozen=True)
class Section:
    stream: int
    layer: int
    part: int
    offset: int
    length: int
    checksum: int


@dataclass(frozen=True)
class ChunkHeader:
    version: int
    flags: int
    layout_hash: int
    start_token: int
    num_tokens: int
    tokens_hash: int
    stored_payload_len: int
    raw_payload_len: int
    sections: tuple[Section, ...]
    payload_offset: int

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_ZSTD)

    @property
    def ephemeral(self) -> bool:
        return bool(self.flags & FLAG_EPHEMERAL)

    @property
    def encoded_len(self) -> int:
        return self.payload_offset + self.stored_payload_len


@dataclass(frozen=True)
class DecodedChunk:
    header: ChunkHeader
    streams: dict[str, StreamData]  # codes (len(layers), entries, ...) when layers were chosen


def _streams_of(spec: LayoutSpec, ephemeral: bool) -> tuple[Stream, ...]:
    return spec.ephemeral_streams if ephemeral else spec.persistent_streams


def _expected_shapes(stream: Stream, num_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    entries = stream.entries_for(num_tokens)
    return (
        (stream.layers, entries, *stream.codes_shape),
        (stream.layers, entries, stream.scales_per_entry),
    )


def tokens_hash(token_ids: Sequence[int] | np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(token_bytes(token_ids))


def encode_chunk(
    spec: LayoutSpec,
    start_token: int,
    token_ids: Sequence[int] | np.ndarray,
    streams: Mapping[str, StreamData],
    *,
    ephemeral: bool = False,
    zstd_level: int | None = None,
) -> bytes:
    """Encode the persistent (or, with ``ephemeral``, the window) streams of a token range."""
    wanted = _streams_of(spec, ephemeral)
    names = {s.name for s in wanted}
    if set(streams) != names:
        raise LayoutMismatch(
            f"layout {spec.name} expects streams {sorted(names)}, got {sorted(streams)}"
        )
    num_tokens = len(token_ids)
    table, blobs, offset = [], [], 0
    for index, stream in enumerate(wanted):
        data = streams[stream.name]
        codes_shape, scales_shape = _expected_shapes(stream, num_tokens)
        parts = [(PART_CODES, data.codes, codes_shape, _CODE_DTYPES[stream.bits])]
        if stream.bits < 16:
            parts.append((PART_SCALES, data.scales, scales_shape, torch.float16))
        elif data.scales is not None:
            raise LayoutMismatch(f"stream {stream.name} is bf16 and takes no scales")
        for part, tensor, shape, dtype in parts:
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                got = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
                raise LayoutMismatch(
                    f"stream {stream.name} part {part}: expected {shape} {dtype} for "
                    f"{num_tokens} tokens, got {got}"
                )
            flat = (
                tensor.detach().to("cpu").contiguous().view(torch.uint8).reshape(stream.layers, -1)
            )
            for layer in range(stream.layers):
                raw = flat[layer].numpy().tobytes()
                table.append(
                    _SECTION.pack(
                        index, layer, part, offset, len(raw), xxhash.xxh3_64_intdigest(raw)
                    )
                )
                blobs.append(raw)
                offset += len(raw)
    raw_payload = b"".join(blobs)
    flags = FLAG_EPHEMERAL if ephemeral else 0
    payload = raw_payload
    if zstd_level is not None:
        payload = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True).compress(
            raw_payload
        )
        flags |= FLAG_ZSTD
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        flags,
        spec.layout_hash,
        start_token,
        num_tokens,
        len(table),
        tokens_hash(token_ids),
        len(payload),
        len(raw_payload),
    ) + b"".join(table)
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head)) + payload


def read_header(buf: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parse and check the header and section table (not the payload bytes)."""
    view = memoryview(buf).cast("B")
    if len(view) < _HEADER.size:
        raise ChunkTruncated(
            f"chunk of {len(view)} bytes is shorter than its {_HEADER.size}-byte header"
        )
    (magic, version, flags, layout_hash, start, ntok, nsec, thash, stored, raw) = (
        _HEADER.unpack_from(view)
    )
    if magic != MAGIC:
        raise ChunkCorrupt(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise UnsupportedVersion(f"chunk format version {version}; this build reads {VERSION}")
    if nsec > MAX_SECTIONS or raw > MAX_PAYLOAD or stored > MAX_PAYLOAD:
        raise ChunkCorrupt(f"implausible header: {nsec} sections, payload {stored}/{raw} bytes")
    table_end = _HEADER.size + nsec * _SECTION.size
    payload_offset = table_end + _CHECK.size
    if len(view) < payload_offset:
        raise ChunkTruncated(f"chunk of {len(view)} bytes ends inside its section table")
    (check,) = _CHECK.unpack_from(view, table_end)
    if xxhash.xxh3_64_intdigest(view[:table_end]) != check:
        raise ChunkCorrupt("header checksum mismatch")
    if flags & ~_KNOWN_FLAGS:
        raise ChunkCorrupt(f"unknown flags {flags:#x}")
    if len(view) < payload_offset + stored:
        raise ChunkTruncated(f"payload is {len(view) - payload_offset} bytes, header says {stored}")
    if len(view) > payload_offset + stored:
        raise ChunkCorrupt(f"{len(view) - payload_offset - stored} trailing bytes after payload")
    sections, expected_offset = [], 0
    for i in range(nsec):
        s = Section(*_SECTION.unpack_from(view, _HEADER.size + i * _SECTION.size))
        if s.offset != expected_offset or s.offset + s.length > raw:
            raise ChunkCorrupt(
                f"section {i} at {s.offset}+{s.length} lies outside the payload of {raw}"
            )
        expected_offset += s.length
        sections.append(s)
    if expected_offset != raw:
        raise ChunkCorrupt(f"sections cover {expected_offset} of {raw} payload bytes")
    if not flags & FLAG_ZSTD and stored != raw:
        raise ChunkCorrupt(f"uncompressed payload stored as {stored} bytes, raw {raw}")
    return ChunkHeader(
        version,
        flags,
        layout_hash,
        start,
        ntok,
        thash,
        stored,
        raw,
        tuple(sections),
        payload_offset,
    )


def _raw_payload(view: memoryview, header: ChunkHeader) -> memoryview:
    stored = view[header.payload_offset : header.encoded_len]
    if not header.compressed:
        return stored
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            stored, max_output_size=header.raw_payload_len
        )
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(f"zstd payload does not decompress: {exc}") from exc
    if len(raw) != header.raw_payload_len:
        raise ChunkCorrupt(
            f"zstd payload is {len(raw)} bytes, header says {header.raw_payload_len}"
        )
    return memoryview(raw)


def _check_section(payload: memoryview, s: Section) -> memoryview:
    part = payload[s.offset : s.offset + s.length]
    if xxhash.xxh3_64_intdigest(part) != s.checksum:
        raise ChunkCorrupt(
            f"checksum mismatch in section stream={s.stream} layer={s.layer} part={s.part}"
        )
    return part


def verify_chunk(buf: bytes | bytearray | memoryview) -> ChunkHeader:
    """Check every byte of a chunk; return its header."""
    view = memoryview(buf).cast("B")
    header = read_header(view)
    payload = _raw_payload(view, header)
    for s in header.sections:
        _check_section(payload, s)
    return header


def decode_chunk(
    buf: bytes | bytearray | memoryview,
    spec: LayoutSpec,
    *,
    streams: Iterable[str] | None = None,
    layers: Sequence[int] | None = None,
    token_ids: Sequence[int] | np.ndarray | None = None,
) -> DecodedChunk:
    """Decode (a subset of) a chunk into fresh tensors, verifying what it reads.

    ``layers`` selects layer indices of every chosen stream (layer-by-layer restore);
    ``token_ids``, when given, must be the ids the chunk was encoded with.
    """
    view = memoryview(buf).cast("B")
    header = read_header(view)
    if header.layout_hash != spec.layout_hash:
        raise LayoutMismatch(
            f"chunk belongs to layout {header.layout_hash:016x}, not {spec.layout_id}"
        )
    if token_ids is not None and (
        len(token_ids) != header.num_tokens or tokens_hash(token_ids) != header.tokens_hash
    ):
        raise LayoutMismatch("chunk was encoded for other token ids")
    stream_list = _streams_of(spec, header.ephemeral)
    expected = sum(s.layers * (1 if s.bits == 16 else 2) for s in stream_list)
    if len(header.sections) != expected:
        raise ChunkCorrupt(f"{len(header.sections)} sections, layout {spec.name} needs {expected}")
    chosen = {s.name for s in stream_list} if streams is None else set(streams)
    unknown = chosen - {s.name for s in stream_list}
    if unknown:
        kind = "ephemeral" if header.ephemeral else "persistent"
        raise LayoutMismatch(f"layout {spec.name} has no {kind} streams {sorted(unknown)}")
    payload = _raw_payload(view, header)
    by_key = {(s.stream, s.layer, s.part): s for s in header.sections}
    out: dict[str, StreamData] = {}
    for index, stream in enumerate(stream_list):
        if stream.name not in chosen:
            continue
        wanted_layers = range(stream.layers) if layers is None else layers
        codes_shape, scales_shape = _expected_shapes(stream, header.num_tokens)
        parts = {PART_CODES: (codes_shape, _CODE_DTYPES[stream.bits])}
        if stream.bits < 16:
            parts[PART_SCALES] = (scales_shape, torch.float16)
        decoded = {}
        for part, (shape, dtype) in parts.items():
            per_layer = shape[1:]
            nbytes = int(np.prod(per_layer)) * torch.empty((), dtype=dtype).element_size()
            out_arr = np.empty((len(wanted_layers), nbytes), dtype=np.uint8)
            for row, layer in enumerate(wanted_layers):
                s = by_key.get((index, layer, part))
                if s is None:
                    raise LayoutMismatch(f"stream {stream.name} has no layer {layer}")
                if s.length != nbytes:
                    raise ChunkCorrupt(
                        f"section of {stream.name} layer {layer} is {s.length} bytes, "
                        f"expected {nbytes}"
                    )
                out_arr[row] = np.frombuffer(_check_section(payload, s), dtype=np.uint8)
            tensor = torch.from_numpy(out_arr).view(dtype).reshape(len(wanted_layers), *per_layer)
            decoded[part] = tensor
        out[stream.name] = StreamData(decoded[PART_CODES], decoded.get(PART_SCALES))
    return DecodedChunk(header, out)
