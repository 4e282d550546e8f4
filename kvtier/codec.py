"""The client's tensor side: cut a session's streams into chunks and encode them, and
turn restored bytes back into tensors. No gRPC here; torch is loaded by the calls that
make or read tensors.

Tensor layouts (per stream of the layout spec, see ``kvstore.format.chunk_parts``):
  persistent stream: codes (layers, entries, *codes_shape) of the format's dtype, scales
      (layers, entries, groups) float16 for int4/int8, None for bf16/fp16, and for fp8
      (layers, chunks) float32: column c the scale of chunk c (the tail is the last
      chunk), or (layers, 1) on encode for one scale in every chunk;
      entries = stream.entries_for(num_tokens)
  window stream: the same for the tokens it covers (ephemeral streams only: the window
      K/V over the last W tokens, pending rows over the last num_tokens % m)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from kvstore.format.checks import check_part
from kvstore.format.chunk import (
    Buffer,
    LayerSlice,
    StreamData,
    decode_chunk,
    encode_chunk,
    read_header,
    split_chunks,
)
from kvstore.format.chunk_parts import code_dtype, scales_dtype, tensor_scale_fault
from kvstore.format.chunk_run import PackedRun, decode_chunks
from kvstore.format.errors import ChunkCorrupt, DataLoss, InvalidRequest, LayoutMismatch
from kvstore.format.keys import chain_keys, chunk_digest, token_bytes
from kvstore.format.layer_sections import LayerCheck
from kvstore.format.layout import LayoutSpec
from kvstore.format.window import encode_window as encode_window_blob
from kvtier.types import TokenIds

if TYPE_CHECKING:
    import torch

    from proto import kvtier_pb2 as pb

Streams = Mapping[str, StreamData]


def as_tokens(token_ids: TokenIds) -> np.ndarray:
    """Token ids (sequence, numpy array or 1-D tensor) as (num_tokens,) little-endian uint32."""
    torch_module = sys.modules.get("torch")  # not imported: token_ids cannot be a tensor
    if torch_module is not None and isinstance(token_ids, torch_module.Tensor):
        return np.frombuffer(token_bytes(token_ids.detach().cpu().numpy()), dtype="<u4")
    # not a tensor (torch would be imported to make one)
    return np.frombuffer(token_bytes(cast("Sequence[int] | np.ndarray", token_ids)),
                         dtype="<u4")


def _check_streams(spec: LayoutSpec, streams: Streams, ephemeral: bool, what: str) -> None:
    """The layout's streams, each a StreamData of (layers, entries, ...); raises on a
    mismatch. (Entry counts are checked against the token count by the caller: streams of
    different m cover different whole-entry token counts, e.g. 300 tokens at m = 4 and 128.)"""
    expected = spec.ephemeral_streams if ephemeral else spec.persistent_streams
    names = {s.name for s in expected}
    if set(streams) != names:
        raise LayoutMismatch(f"{what}: layout {spec.name} expects streams {sorted(names)}, "
                             f"got {sorted(streams)}")
    for stream in expected:
        data = streams[stream.name]
        if not isinstance(data, StreamData):
            raise InvalidRequest(f"{what}: stream {stream.name} must be a kvstore.format.chunk."
                                 f"StreamData, got {type(data).__name__}")
        if data.codes.dim() < 2 or data.codes.shape[0] != stream.layers:
            raise LayoutMismatch(f"{what}: stream {stream.name} codes must be (layers="
                                 f"{stream.layers}, entries, ...), got {tuple(data.codes.shape)}")


@dataclass
class EncodedSession:
    keys: list[str]  # chained keys of the complete chunks
    digests: list[bytes]  # BLAKE2b-256 of each complete chunk's bytes (kvstore.format.keys)
    chunks: dict[int, bytes]  # index -> encoded chunk, for the indices asked for
    tail: bytes  # b"" when the tokens fill whole chunks
    window: bytes | None


def encoded_chunks(spec: LayoutSpec, tokens: np.ndarray, chunks: Sequence[bytes], tail: bytes,
                   *, scope: str, model_fingerprint: str = "",
                   held: Mapping[str, bytes] | None = None) -> EncodedSession:
    """Already encoded chunks, keyed and digested from their bytes; those ``held`` names
    with the same digest (chain key -> digest the server holds) are left out of
    ``chunks``."""
    keys = chain_keys(spec.layout_id, tokens, spec.chunk_tokens, scope=scope,
                      model_fingerprint=model_fingerprint)
    if len(chunks) != len(keys):
        raise InvalidRequest(f"{len(tokens)} tokens make {len(keys)} chunks of "
                             f"{spec.chunk_tokens}; {len(chunks)} were given")
    digests, unheld = _unheld(keys, chunks, held)
    return EncodedSession(keys, digests, unheld, tail, None)


def _unheld(keys: Sequence[str], chunks: Sequence[bytes], held: Mapping[str, bytes] | None
            ) -> tuple[list[bytes], dict[int, bytes]]:
    """The digest of every chunk's bytes, and the chunks to send: all but those ``held``
    names under the same key with that same digest."""
    digests = [chunk_digest(c) for c in chunks]
    held = held or {}
    return digests, {i: c for i, c in enumerate(chunks) if held.get(keys[i]) != digests[i]}


def encode_session(
    spec: LayoutSpec,
    tokens: np.ndarray,
    persistent: Streams,
    *,
    scope: str,
    model_fingerprint: str = "",
    held: Mapping[str, bytes] | None = None,
    zstd_level: int | None = None,
) -> EncodedSession:
    """Cut (layers, entries, ...) streams into chunks of ``spec.chunk_tokens`` and encode
    every one of them: each digest is of the bytes encoded now. A chunk ``held`` names
    (chain key -> digest of the bytes the server holds) with that very digest is left
    out of ``chunks`` and goes by key and digest; any other is sent."""
    entries_needed = {s.name: s.entries_for(len(tokens)) for s in spec.persistent_streams}
    _check_streams(spec, persistent, False, "persistent streams")
    for name, need in entries_needed.items():
        if persistent[name].codes.shape[1] != need:
            raise LayoutMismatch(f"stream {name} has {persistent[name].codes.shape[1]} "
                                 f"entries; {len(tokens)} tokens need {need}")
    size = spec.chunk_tokens
    _check_tensor_scales(spec, persistent, -(-len(tokens) // size))
    keys = chain_keys(spec.layout_id, tokens, spec.chunk_tokens, scope=scope,
                      model_fingerprint=model_fingerprint)
    encoded = _encoded(spec, tokens, persistent, range(len(keys)), 0, zstd_level)
    digests, chunks = _unheld(keys, encoded, held)
    covered = len(keys) * size
    tail = b""
    if covered < len(tokens):
        tail = encode_chunk(spec, covered, tokens[covered:],
                            _slice(spec, persistent, covered, len(tokens)), zstd_level=zstd_level)
    return EncodedSession(keys, digests, chunks, tail, None)


def encode_chunks(spec: LayoutSpec, tokens: np.ndarray, persistent: Streams, *,
                  first_chunk: int = 0, zstd_level: int | None = None) -> list[bytes]:
    """The whole chunks of ``tokens`` from ``first_chunk`` on, encoded (what
    ``AsyncClient.write_chunks`` takes); ``persistent``: streams (layers, entries, ...)
    over exactly those tokens, ``tokens[first_chunk * chunk_tokens : whole chunks]``."""
    size = spec.chunk_tokens
    whole = len(tokens) // size
    if not 0 <= first_chunk <= whole:
        raise InvalidRequest(f"first_chunk {first_chunk} is not in [0, {whole}] (the whole "
                             f"chunks of {len(tokens)} tokens)")
    _check_streams(spec, persistent, False, "persistent streams")
    origin = first_chunk * size
    _check_tensor_scales(spec, persistent, whole - first_chunk)
    for s in spec.persistent_streams:
        need = s.entries_for(whole * size) - origin // s.tokens_per_entry
        if persistent[s.name].codes.shape[1] != need:
            raise LayoutMismatch(f"stream {s.name} has {persistent[s.name].codes.shape[1]} "
                                 f"entries; tokens {origin}..{whole * size} need {need}")
    return _encoded(spec, tokens, persistent, range(first_chunk, whole), origin, zstd_level)


def _encoded(spec: LayoutSpec, tokens: np.ndarray, streams: Streams, indices: range,
             origin: int, zstd_level: int | None) -> list[bytes]:
    """Chunks ``indices`` encoded from ``streams``, which start at token ``origin`` (a
    chunk boundary)."""
    size = spec.chunk_tokens
    return [encode_chunk(spec, i * size, tokens[i * size:(i + 1) * size],
                         _slice(spec, streams, i * size - origin, (i + 1) * size - origin),
                         zstd_level=zstd_level) for i in indices]


def _check_tensor_scales(spec: LayoutSpec, streams: Streams, chunks: int) -> None:
    """An fp8 stream's scales are (layers, 1) (every chunk's) or (layers, chunks)."""
    for s in spec.persistent_streams:
        scales = streams[s.name].scales
        if s.value_format.scales != "tensor":
            continue
        if scales is None or scales.dim() != 2 or scales.shape[1] not in (1, chunks):
            got = None if scales is None else tuple(scales.shape)
            raise LayoutMismatch(f"stream {s.name} is {s.format}: its scales must be "
                                 f"(layers, 1) or (layers, {chunks}) float32, got {got}")


def _slice(spec: LayoutSpec, streams: Streams, start: int, stop: int) -> dict[str, StreamData]:
    out = {}
    for s in spec.persistent_streams:
        data = streams[s.name]
        a, b = start // s.tokens_per_entry, s.entries_for(stop)
        scales = data.scales
        if s.value_format.scales == "group":
            assert scales is not None  # a group format has scales
            scales = scales[:, a:b]
        elif scales is not None and scales.shape[1] > 1:  # fp8: this chunk's column
            chunk = start // spec.chunk_tokens
            scales = scales[:, chunk:chunk + 1]
        out[s.name] = StreamData(data.codes[:, a:b], scales)
    return out


def encode_window(spec: LayoutSpec, tokens: np.ndarray, window: Streams) -> bytes:
    """The window blob of ``window``'s ephemeral streams (``kvstore.format.window``)."""
    return encode_window_blob(spec, tokens, window)


def check_digests(chunks: Sequence[bytes | memoryview], digests: Sequence[bytes],
                  tail: bytes | memoryview, tail_digest: bytes) -> None:
    """Every restored chunk and the tail must have the digest its spiller stated (the
    server sends them in the header): ``DataLoss`` names the first that does not."""
    if len(chunks) != len(digests):
        raise DataLoss(f"the restore sent {len(chunks)} chunks for {len(digests)} digests")
    for i, (data, want) in enumerate(zip(chunks, digests, strict=True)):
        if chunk_digest(data) != want:
            raise DataLoss(f"restored chunk {i} does not have the digest it was spilled with")
    if (chunk_digest(tail) if len(tail) else b"") != tail_digest:
        raise DataLoss("the restored tail does not have the digest it was spilled with")


def decode_persistent(spec: LayoutSpec, tokens: np.ndarray, chunks: Sequence[Buffer],
                      tail: Buffer) -> dict[str, StreamData]:
    """The whole session's persistent streams, (layers, entries, ...) each, verified."""

    if not len(chunks) and not len(tail):
        return {}
    bufs, counts = chunks, [spec.chunk_tokens] * len(chunks)
    if len(tail):
        # chunks packed in one buffer with the tail after them are decoded without a join
        packed = chunks.followed_by(tail) if isinstance(chunks, PackedRun) else None
        bufs = packed if packed is not None else [*chunks, tail]
        counts.append(read_header(tail).num_tokens)
    try:
        return decode_chunks(bufs, spec, tokens, counts)
    except InvalidRequest as exc:  # the server sent chunks that do not fit the session
        raise ChunkCorrupt(str(exc)) from exc


def check_window_digest(window: Buffer, stated: bytes) -> None:
    """A restored window must have the digest its reply states (``SessionHeader`` for a
    held window, ``ResumeSummary`` for one the Resume rebuilt): ``DataLoss`` if not."""
    if chunk_digest(window) != stated:
        raise DataLoss("the restored window does not have the digest its reply states"
                       + ("" if stated else " (it states none)"))


def window_start(window: Buffer) -> int:
    """First token covered by the window blob's first (window K/V) chunk."""
    return read_header(split_chunks(window)[0]).start_token


def decode_window(spec: LayoutSpec, tokens: np.ndarray, window: Buffer
                  ) -> tuple[dict[str, StreamData], int]:
    """Every ephemeral stream of the window blob, and the first token of its first chunk."""
    out: dict[str, StreamData] = {}
    parts = split_chunks(window)
    for part in parts:
        header = read_header(part)
        start, count = header.start_token, header.num_tokens
        if not header.ephemeral or start + count > len(tokens):
            raise ChunkCorrupt("the window blob does not fit the session")
        try:
            check_part(spec, len(tokens), header)
        except InvalidRequest as exc:
            raise ChunkCorrupt(f"the window blob does not fit the session: {exc}") from exc
        out.update(decode_chunk(part, spec, token_ids=tokens[start:start + count]).streams)
    return out, read_header(parts[0]).start_token if parts else 0


@dataclass
class LayerAssembler:
    """Collects ``LayerSection`` messages, each checked as it comes against its chunk's
    table (``kvstore.format.layer_sections.LayerCheck``: order, lengths, checksums), and
    yields each (stream, layer) when complete; ``finish`` yields the last one once the
    digests of the uncompressed chunks have been checked."""

    spec: LayoutSpec
    check: LayerCheck
    parts: list[tuple[bytes, bytes]] = field(default_factory=list)
    current: tuple[str, int] | None = None

    @classmethod
    def for_header(cls, spec: LayoutSpec, header: pb.SessionHeader) -> LayerAssembler:
        """For the sections of the restore whose ``SessionHeader`` is ``header``."""
        tokens = as_tokens(np.frombuffer(header.token_ids, dtype="<u4"))
        return cls(spec, LayerCheck(spec, tokens, header.chunk_tables, header.chunk_digests,
                                    header.tail_digest))

    def add(self, section: pb.LayerSection) -> LayerSlice | None:
        self.check.add(section.stream, section.layer, section.chunk_index, section.codes,
                       section.scales, section.codes_xxh3, section.scales_xxh3)
        key = (section.stream, section.layer)
        done = None
        if self.current is not None and key != self.current:
            done = self._complete()
        self.current = key
        self.parts.append((section.codes, section.scales))
        return done

    def finish(self) -> LayerSlice | None:
        """The last (stream, layer), once every section came and every digest held."""
        self.check.finish()
        return self._complete()

    def _complete(self) -> LayerSlice | None:
        if self.current is None:
            return None
        name, layer = self.current
        stream = self.spec.stream(name)
        what = f"stream {name} layer {layer}"
        codes = _tensor(b"".join(c for c, _ in self.parts), code_dtype(stream),
                        stream.codes_shape, what)
        scales = None
        kind = stream.value_format.scales
        if kind != "none":
            # group: (entries, groups) float16; tensor: (chunks,) float32, one a section
            dtype = scales_dtype(stream)
            assert dtype is not None  # a format with scales
            scales = _tensor(b"".join(s for _, s in self.parts), dtype,
                             (stream.scales_per_entry,) if kind == "group" else (), what)
            if kind == "tensor":
                fault = (tensor_scale_fault(name, scales.numpy()) if len(scales) ==
                         len(self.parts) else f"{what}: {len(scales)} fp8 scales in "
                         f"{len(self.parts)} chunks")
                if fault:
                    raise ChunkCorrupt(fault)
        self.parts, self.current = [], None
        return LayerSlice(name, layer, StreamData(codes, scales))


def _tensor(raw: bytes, dtype: torch.dtype, entry_shape: tuple[int, ...], what: str
            ) -> torch.Tensor:
    """(entries, *entry_shape) tensor owning a copy of ``raw``; ChunkCorrupt unless
    ``raw`` is whole entries."""
    import torch

    entry_bytes = dtype.itemsize * math.prod(entry_shape)
    if len(raw) % entry_bytes:
        raise ChunkCorrupt(f"{what}: {len(raw)} B is not a whole number of {entry_bytes} B "
                           f"entries of {dtype}")
    if not raw:
        return torch.empty((0, *entry_shape), dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(dtype).reshape(-1, *entry_shape)
