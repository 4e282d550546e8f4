"""The on-media format of one chunk: a session's KV for a token range, all streams.

Layout of a chunk (little-endian)::

    header    magic "KVTC", version, flags, layout hash, start token, token count,
              section count, xxh3 of the token ids, stored and raw payload lengths,
              (version 2) xxh3-64 of the payload as stored (the zstd frame when
              compressed, so every stored byte is covered)
    sections  one entry per (stream, layer, part): stream index, layer, part (codes or
              scales), offset and length in the raw payload, xxh3-64 of the section bytes
    check     xxh3-64 of header + section table
    payload   the sections back to back, zstd-compressed as a whole when flagged

Codes and scales per stream format (docs/wire-format.md "Value formats"): int4 packed two
per byte (uint8) or int8 with fp16 group scales; bf16 or fp16 without scales; fp8 e4m3
with one float32 scale per layer, which must be finite and > 0.
A compressed payload is one zstd frame that declares its content size: the size is checked
against the header (and, through the section table, the layout) before anything is
decompressed, so a small chunk can never expand into a large allocation.
The header checksum covers the section table, and the table holds each section's checksum,
so every byte is covered while a reader of one layer verifies only what it reads; a
reader of the whole payload checks it with one hash (version 2), not one per section.
Version 1 chunks (no payload checksum) are still read, their sections checked one by one.
Anything that does not check out raises a ``CodecError`` subclass: never a wrong tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash
import zstandard

from kvstore.format.chunk_parts import (
    PART_CODES,
    PART_SCALES,
    ChunkPlan,
    check_tensor_scales,
    chunk_plan,
    max_chunk_tokens,
    streams_of,
    tensor_scale_fault,
)
from kvstore.format.errors import (
    ChunkCorrupt,
    ChunkTruncated,
    InvalidRequest,
    LayoutMismatch,
    UnknownLayout,
    UnsupportedVersion,
)
from kvstore.format.keys import token_bytes
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import layout_by_hash
from kvstore.format.stream_data import StreamData as StreamData  # re-exported
from kvstore.format.zstd_frame import check_frame, decompressed

if TYPE_CHECKING:  # torch is imported by the calls that make or read tensors
    import torch

Buffer = bytes | bytearray | memoryview  # what chunk bytes may be given as
MAGIC = b"KVTC"
VERSION = 2  # 2: the header holds the stored payload's xxh3-64
FLAG_ZSTD = 1
FLAG_EPHEMERAL = 2
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_EPHEMERAL

_HEADER_V1 = struct.Struct("<4sHHQQIIQQQ")
_HEADER = struct.Struct(_HEADER_V1.format + "Q")
_SECTION = struct.Struct("<HHB3xQQQ")
# The same record as a numpy dtype, so a table of hundreds of sections parses in one call.
SECTION_DTYPE = np.dtype([("stream", "<u2"), ("layer", "<u2"), ("part", "u1"), ("pad", "V3"),
                          ("offset", "<u8"), ("length", "<u8"), ("checksum", "<u8")])
_CHECK = struct.Struct("<Q")
# The version 2 header as a numpy dtype, so a run's headers are checked in a few calls.
HEADER_DTYPE = np.dtype([("magic", "S4"), ("version", "<u2"), ("flags", "<u2"),
                         ("layout_hash", "<u8"), ("start_token", "<u8"), ("num_tokens", "<u4"),
                         ("sections", "<u4"), ("tokens_hash", "<u8"), ("stored_len", "<u8"),
                         ("raw_len", "<u8"), ("payload_checksum", "<u8")])
assert HEADER_DTYPE.itemsize == _HEADER.size
assert HEADER_DTYPE.fields is not None  # a structured dtype
_FLAGS_FIELD = HEADER_DTYPE.fields["flags"]
# where a chunk's header holds its flags (<u2), for callers that look at them alone
FLAGS_BYTES = slice(_FLAGS_FIELD[1], _FLAGS_FIELD[1] + _FLAGS_FIELD[0].itemsize)
# Bounds a corrupt header can claim, so decoding never tries to allocate absurd sizes.
MAX_SECTIONS = 1 << 16
MAX_PAYLOAD = 1 << 34
# What zstd may add to an incompressible payload, beyond ZSTD_compressBound's n / 256.
ZSTD_SLACK = 1024


@dataclass(frozen=True)
class LayerSlice:
    """One owning layer of one stream, as a layer-by-layer restore yields it."""

    stream: str
    layer: int  # index among the stream's owning layers
    # codes (entries, *codes_shape); scales (entries, groups), (chunks,) float32 for
    # fp8_e4m3, or None
    data: StreamData


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
    payload_checksum: int | None  # xxh3-64 of the stored payload; None in version 1
    sections: np.ndarray  # (n,) SECTION_DTYPE, in payload order
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
    import torch

    num_tokens = len(token_ids)
    ordered = [st.name for st in streams_of(spec, ephemeral)]
    # A window blob may carry only some ephemeral streams (the window K/V and, separately,
    # the pending rows of fewer than m tokens); persistent chunks always carry all (none
    # for a layout of window streams alone: the chunk holds token ids only).
    if (
        set(streams) - set(ordered)
        or (not streams and (ephemeral or ordered))
        or (not ephemeral and len(streams) != len(ordered))
    ):
        kind = "ephemeral" if ephemeral else "persistent"
        raise LayoutMismatch(
            f"layout {spec.name} expects {kind} streams {ordered}, got {sorted(streams)}"
        )
    names = None if len(streams) == len(ordered) else tuple(n for n in ordered if n in streams)
    plan = chunk_plan(spec, num_tokens, ephemeral, names)
    blobs = []
    for p in plan.parts:
        data = streams[p.stream.name]
        tensor = data.codes if p.part == PART_CODES else data.scales
        if p.stream.value_format.scales == "none" and data.scales is not None:
            raise LayoutMismatch(f"stream {p.stream.name} is {p.stream.format} and takes no "
                                 "scales")
        if tensor is None or tuple(tensor.shape) != p.shape or tensor.dtype != p.dtype:
            got = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
            raise LayoutMismatch(
                f"stream {p.stream.name} part {p.part}: expected {p.shape} {p.dtype} for "
                f"{num_tokens} tokens, got {got}"
            )
        if p.part == PART_SCALES and p.stream.value_format.scales == "tensor":
            fault = tensor_scale_fault(p.stream.name, tensor.detach().cpu().numpy())
            if fault:
                raise InvalidRequest(fault)
        blobs.append(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return encode_raw(spec, start_token, token_ids, b"".join(blobs), ephemeral=ephemeral,
                      names=names, zstd_level=zstd_level)


def encode_raw(spec: LayoutSpec, start_token: int, token_ids: Sequence[int] | np.ndarray,
               raw_payload: bytes | memoryview, *, ephemeral: bool = False,
               names: tuple[str, ...] | None = None, zstd_level: int | None = None) -> bytes:
    """Encode a raw payload already in the plan's part order (every section's bytes back
    to back, ``chunk_plan(spec, len(token_ids), ephemeral, names)``): no torch needed."""
    if zstd_level is None:
        head = encode_head(spec, start_token, token_ids, raw_payload, ephemeral=ephemeral,
                           names=names)
        return head + raw_payload
    compressed = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True
                                          ).compress(raw_payload)
    return _encode(spec, start_token, token_ids, raw_payload, ephemeral, names,
                   compressed) + compressed


def encode_head(spec: LayoutSpec, start_token: int, token_ids: Sequence[int] | np.ndarray,
                raw_payload: Buffer, *, ephemeral: bool = False,
                names: tuple[str, ...] | None = None) -> bytes:
    """The bytes before the payload (header, section table, check) of the uncompressed
    chunk ``encode_raw`` makes of ``raw_payload``: that chunk is these bytes, then the
    payload, so a caller that lays payloads out in place writes only these."""
    return _encode(spec, start_token, token_ids, raw_payload, ephemeral, names, None)


def head_bytes(spec: LayoutSpec, num_tokens: int) -> int:
    """The length of ``encode_head``'s bytes for a persistent chunk of ``num_tokens``:
    where its payload starts."""
    rows = len(chunk_plan(spec, num_tokens, False).table_head)
    return _HEADER.size + rows * _SECTION.size + _CHECK.size


def _encode(spec: LayoutSpec, start_token: int, token_ids: Sequence[int] | np.ndarray,
            raw_payload: Buffer, ephemeral: bool, names: tuple[str, ...] | None,
            compressed: bytes | None) -> bytes:
    """A chunk's header, section table and check; ``compressed``: its zstd payload, None
    when it holds ``raw_payload`` as it is."""
    plan = chunk_plan(spec, len(token_ids), ephemeral, names)
    view = memoryview(raw_payload).cast("B")
    if len(view) != plan.payload_bytes:
        raise LayoutMismatch(f"a raw payload of {len(view)} B; layout {spec.name} "
                             f"holds {plan.payload_bytes} B for {len(token_ids)} tokens")
    table = np.zeros(len(plan.table_head), SECTION_DTYPE)
    table.view(np.uint64).reshape(-1, 4)[:, :3] = plan.table_head
    table["checksum"] = [
        xxhash.xxh3_64_intdigest(view[int(off) : int(off) + int(n)])
        for _, off, n in plan.table_head
    ]
    flags = FLAG_EPHEMERAL if ephemeral else 0
    payload: Buffer = view
    if compressed is not None:
        payload = compressed
        flags |= FLAG_ZSTD
    head = (
        _HEADER.pack(
            MAGIC,
            VERSION,
            flags,
            spec.layout_hash,
            start_token,
            len(token_ids),
            len(table),
            tokens_hash(token_ids),
            len(payload),
            len(view),
            xxhash.xxh3_64_intdigest(payload),
        )
        + table.tobytes()
    )
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def max_encoded_bytes(spec: LayoutSpec, num_tokens: int, ephemeral: bool,
                      names: tuple[str, ...] | None = None) -> int:
    """The most bytes an encoding of these streams over ``num_tokens`` tokens can take:
    header, section table and payload, with room for zstd's expansion of incompressible
    data."""
    plan = chunk_plan(spec, num_tokens, ephemeral, names)
    table = _HEADER.size + len(plan.table_head) * _SECTION.size + _CHECK.size
    return table + plan.payload_bytes + plan.payload_bytes // 256 + ZSTD_SLACK


def read_header(buf: Buffer) -> ChunkHeader:
    """Parse and check the header and section table (not the payload bytes)."""
    view = memoryview(buf).cast("B")
    header = _parse_header(view)
    if len(view) > header.encoded_len:
        raise ChunkCorrupt(f"{len(view) - header.encoded_len} trailing bytes after payload")
    return header


def read_table(buf: Buffer) -> ChunkHeader:
    """Parse and check a chunk's leading ``payload_offset`` bytes alone (header, section
    table, check), as a layer-by-layer restore's header carries them."""
    view = memoryview(buf).cast("B")
    header = _parse_header(view, payload=False)
    if len(view) != header.payload_offset:
        raise ChunkCorrupt(f"a chunk table of {len(view)} bytes; its header says "
                           f"{header.payload_offset}")
    return header


def split_chunks(buf: Buffer) -> list[memoryview]:
    """Cut a concatenation of encoded chunks (a window blob) into its chunks, unverified."""
    view, out = memoryview(buf).cast("B"), []
    while view:
        end = _parse_header(view).encoded_len
        out.append(view[:end])
        view = view[end:]
    return out


def _parse_header(view: memoryview, *, payload: bool = True) -> ChunkHeader:  # noqa: C901 - one check per header field, in wire order
    if len(view) < _HEADER_V1.size:
        raise ChunkTruncated(
            f"chunk of {len(view)} bytes is shorter than its {_HEADER_V1.size}-byte header"
        )
    fields = _HEADER_V1.unpack_from(view)
    magic, version, flags, layout_hash, start, ntok, nsec, thash, stored, raw = fields
    if magic != MAGIC:
        raise ChunkCorrupt(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version not in (1, VERSION):
        raise UnsupportedVersion(f"chunk format version {version}; this build reads 1 and "
                                 f"{VERSION}")
    head = _HEADER_V1 if version == 1 else _HEADER
    if len(view) < head.size:
        raise ChunkTruncated(f"chunk of {len(view)} bytes is shorter than its {head.size}-byte "
                             "header")
    payload_checksum = None if version == 1 else head.unpack_from(view)[-1]
    if nsec > MAX_SECTIONS or raw > MAX_PAYLOAD or stored > MAX_PAYLOAD:
        raise ChunkCorrupt(f"implausible header: {nsec} sections, payload {stored}/{raw} bytes")
    table_end = head.size + nsec * _SECTION.size
    payload_offset = table_end + _CHECK.size
    if len(view) < payload_offset:
        raise ChunkTruncated(f"chunk of {len(view)} bytes ends inside its section table")
    (check,) = _CHECK.unpack_from(view, table_end)
    if xxhash.xxh3_64_intdigest(view[:table_end]) != check:
        raise ChunkCorrupt("header checksum mismatch")
    if flags & ~_KNOWN_FLAGS:
        raise ChunkCorrupt(f"unknown flags {flags:#x}")
    if payload and len(view) < payload_offset + stored:
        raise ChunkTruncated(f"payload is {len(view) - payload_offset} bytes, header says {stored}")
    if not flags & FLAG_ZSTD and stored != raw:
        raise ChunkCorrupt(f"uncompressed payload stored as {stored} bytes, raw {raw}")
    table = np.frombuffer(view, SECTION_DTYPE, count=nsec, offset=head.size)
    covered = 0
    for offset, length in zip(table["offset"].tolist(), table["length"].tolist(), strict=True):
        if offset != covered:
            raise ChunkCorrupt(f"section at {offset} leaves a gap or overlap at {covered}")
        covered += length
    if covered != raw:
        raise ChunkCorrupt(f"sections cover {covered} of {raw} payload bytes")
    return ChunkHeader(version, flags, layout_hash, start, ntok, thash, stored, raw,
                       payload_checksum, table, payload_offset)


def decoded_payload(view: memoryview, header: ChunkHeader, *, copy: bool = True) -> np.ndarray:
    """The raw payload as a fresh, writable array, so tensors decoded from it own their
    memory; ``copy=False``: an uncompressed payload as a view of ``view`` (for a caller
    that copies it anyway)."""
    stored = view[header.payload_offset : header.encoded_len]
    if not header.compressed:
        payload = np.frombuffer(stored, np.uint8)
        return np.array(payload) if copy else payload
    return decompressed(stored, header.raw_payload_len)


def verify_sections(payload: Buffer | np.ndarray, sections: np.ndarray) -> None:
    data = memoryview(payload)  # type: ignore[arg-type]  # numpy declares its buffer protocol for 3.12+ only
    for stream, layer, part, _, offset, length, checksum in sections.tolist():
        if xxhash.xxh3_64_intdigest(data[offset : offset + length]) != checksum:
            raise ChunkCorrupt(
                f"checksum mismatch in section stream={stream} layer={layer} part={part}"
            )


def verify_payload(view: memoryview, header: ChunkHeader, payload: Buffer | np.ndarray
                   ) -> None:
    """Every byte of a chunk's payload: in version 2 one hash of the payload as stored in
    ``view`` (a flipped bit of a zstd frame that decompresses the same is refused too),
    in version 1 each section of the raw ``payload``."""
    if header.payload_checksum is None:
        verify_sections(payload, header.sections)
    elif not stored_intact(view, header):
        raise ChunkCorrupt("payload checksum mismatch")


def stored_intact(view: memoryview, header: ChunkHeader) -> bool:
    """Version 2: the stored payload hashes to the header's checksum."""
    stored = view[header.payload_offset : header.encoded_len]
    return xxhash.xxh3_64_intdigest(stored) == header.payload_checksum


def verify_chunk(buf: Buffer, spec: LayoutSpec | None = None
                 ) -> ChunkHeader:
    """Check every byte of a chunk without copying it; return its header. Its section
    table (hence every size) is checked against ``spec``, or without one against the
    registered layout it names; a chunk of an unregistered layout only against itself."""
    view = memoryview(buf).cast("B")
    if spec is None:
        try:
            spec = layout_by_hash(read_header(view).layout_hash)
        except UnknownLayout:
            spec = None
    header, plan = (read_header(view), None) if spec is None else checked_plan(view, spec, None)
    if header.compressed:
        payload = decoded_payload(view, header)
    else:
        payload = np.frombuffer(view[header.payload_offset : header.encoded_len], np.uint8)
    # both checksums: a chunk whose section and payload checksums disagree is corrupt
    verify_sections(payload, header.sections)
    verify_payload(view, header, payload)
    if plan is not None:
        check_tensor_scales(plan, payload)
    return header


def checked_plan(view: memoryview, spec: LayoutSpec,
                  token_ids: Sequence[int] | np.ndarray | None) -> tuple[ChunkHeader, ChunkPlan]:
    """The chunk's header and the plan its payload follows, once the header, the layout,
    the token ids (when given) and the section table have been checked."""
    header = read_header(view)
    return header, plan_for(header, spec, token_ids)


def plan_for(header: ChunkHeader, spec: LayoutSpec,
             token_ids: Sequence[int] | np.ndarray | None = None) -> ChunkPlan:
    """The plan of a parsed chunk, once its layout, its token ids (when given) and its
    section table (exactly the layout's for its token count) have been checked."""
    if header.layout_hash != spec.layout_hash:
        raise LayoutMismatch(
            f"chunk belongs to layout {header.layout_hash:016x}, not {spec.layout_id}"
        )
    if token_ids is not None and (
        len(token_ids) != header.num_tokens or tokens_hash(token_ids) != header.tokens_hash
    ):
        raise LayoutMismatch("chunk was encoded for other token ids")
    table = header.sections
    ordered = [st.name for st in streams_of(spec, header.ephemeral)]
    present = dict.fromkeys(table["stream"].tolist())
    if any(i >= len(ordered) for i in present):
        raise ChunkCorrupt(f"section table does not match layout {spec.name}: it names "
                           f"streams {sorted(present)}, the layout has {len(ordered)}")
    names = None
    if len(present) != len(ordered):
        if not header.ephemeral:
            raise ChunkCorrupt(f"section table does not match layout {spec.name}: a "
                               f"persistent chunk holds all of {ordered}, this one names "
                               f"only {[ordered[i] for i in present]}")
        names = tuple(ordered[i] for i in present)
    most = max_chunk_tokens(spec, header.ephemeral, names)
    if header.num_tokens > most:
        kind = "ephemeral" if header.ephemeral else "persistent"
        raise ChunkCorrupt(f"{kind} chunk covers {header.num_tokens} tokens; layout "
                           f"{spec.name} holds at most {most} in one")
    plan = chunk_plan(spec, header.num_tokens, header.ephemeral, names)
    # The table must be exactly the one encode_chunk writes for this layout and length.
    if len(table) != len(plan.table_head) or (
        table.view(np.uint64).reshape(-1, 4)[:, :3].tobytes() != plan.table_head.tobytes()
    ):
        raise ChunkCorrupt(f"section table does not match layout {spec.name}: expected "
                           f"{len(plan.table_head)} sections ({plan.payload_bytes} B) for "
                           f"{header.num_tokens} tokens, got {len(table)} "
                           f"({header.raw_payload_len} B)")
    return plan


def checked_header(buf: Buffer, spec: LayoutSpec) -> ChunkHeader:
    """The header of a chunk whose every size is the layout's, read without decompressing
    or hashing the payload: the section table is the layout's for its token count (which
    is within the layout's bound), and a zstd payload declares exactly that raw size."""
    view = memoryview(buf).cast("B")
    header, _ = checked_plan(view, spec, None)
    if header.compressed:
        check_frame(view[header.payload_offset : header.encoded_len], header.raw_payload_len)
    return header


def decode_chunk(
    buf: Buffer,
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
    import torch

    view = memoryview(buf).cast("B")
    header, plan = checked_plan(view, spec, token_ids)
    table = header.sections
    known = {p.stream.name for p in plan.parts}
    chosen = known if streams is None else set(streams)
    if chosen - known:
        kind = "ephemeral" if header.ephemeral else "persistent"
        raise LayoutMismatch(f"layout {spec.name} has no {kind} streams {sorted(chosen - known)}")
    payload = decoded_payload(view, header)
    base = torch.from_numpy(payload)
    selected = []
    for p in plan.parts:
        if p.stream.name not in chosen:
            continue
        picked = range(p.stream.layers) if layers is None else list(layers)
        if any(not 0 <= layer < p.stream.layers for layer in picked):
            raise LayoutMismatch(f"stream {p.stream.name} has layers 0..{p.stream.layers - 1}")
        selected.append((p, picked))
    if streams is None and layers is None:
        verify_payload(view, header, payload)
    else:
        if header.compressed and header.payload_checksum is not None and \
                not stored_intact(view, header):
            raise ChunkCorrupt("payload checksum mismatch")
        verify_sections(payload, table[[p.first_section + layer for p, picked in selected
                                        for layer in picked]])
    check_tensor_scales(plan, payload)
    out: dict[str, dict[int, torch.Tensor]] = {}
    for p, picked in selected:
        if layers is None:
            flat = base[p.offset : p.offset + p.layer_bytes * p.stream.layers]
        else:
            starts = [p.offset + layer * p.layer_bytes for layer in picked]
            flat = torch.cat([base[s : s + p.layer_bytes] for s in starts])
        shape = (len(picked), *p.shape[1:])
        if flat.storage_offset() % p.dtype.itemsize:
            flat = flat.clone()  # a part after odd-sized int4 codes: view() needs alignment
        # An empty slice may carry a stride that view() rejects; it has no bytes to keep.
        part = (
            flat.view(p.dtype).reshape(shape) if flat.numel() else torch.empty(shape, dtype=p.dtype)
        )
        out.setdefault(p.stream.name, {})[p.part] = part
    return DecodedChunk(
        header,
        {
            name: StreamData(parts[PART_CODES], parts.get(PART_SCALES))
            for name, parts in out.items()
        },
    )
