"""A layer-by-layer restore, checked end to end (docs/wire-format.md section 6).

Order: for each layer ``l`` from 0 to the most layers of any persistent stream, for each
persistent stream (layout order) that has layer ``l``, for each chunk in index order and
then the tail (``chunk_index == len(chunk_keys)``): one ``LayerSection``, empty parts
included (a tail shorter than m has no entry of that stream).

The header carries ``chunk_tables``: every chunk's (then the tail's) leading
``payload_offset`` bytes as stored, its header, section table and check. A reader checks
each table (its check, the layout's exact table for its token count, its token range and
token hash), then every section against its record: length and ``xxh3_64`` of its bytes,
before the section is used. A section's ``codes_xxh3`` / ``scales_xxh3`` is the
``xxh3_64`` of its ``codes`` / ``scales`` bytes, empty ones included (a bf16 stream has
no scales part: ``xxh3_64(b"")``). Once the stream has ended, the table and the raw
payload of each uncompressed chunk are its encoded bytes, so their digest is checked
against the one the spill stated; a zstd chunk's digest covers its frame, which layer
mode does not send: its table's checksums are what vouch for its sections.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

from kvstore.format.chunk import (
    Buffer,
    ChunkHeader,
    plan_for,
    read_header,
    read_table,
    tokens_hash,
)
from kvstore.format.errors import ChunkCorrupt, CodecError, DataLoss, InvalidRequest
from kvstore.format.keys import chunk_digest
from kvstore.format.layout import LayoutSpec

EMPTY_XXH3 = xxhash.xxh3_64_intdigest(b"")  # the checksum of an empty part
Section = tuple[int, str, int, int]  # stream index, stream name, layer, chunk index


def section_order(spec: LayoutSpec, blocks: int) -> Iterator[Section]:
    """The sections of ``blocks`` chunks (the tail counted as the last) in the order a
    layer-by-layer restore sends them."""
    streams = spec.persistent_streams
    for layer in range(max((s.layers for s in streams), default=0)):
        for index, stream in enumerate(streams):
            if layer < stream.layers:
                for chunk_index in range(blocks):
                    yield index, stream.name, layer, chunk_index


def chunk_table(buf: Buffer) -> bytes:
    """A whole encoded chunk's table, as ``SessionHeader.chunk_tables`` carries it."""
    view = memoryview(buf).cast("B")
    return bytes(view[:read_header(view).payload_offset])


class LayerCheck:
    """Checks the sections of one layer-by-layer restore as they come (``add``), then
    the digests of its uncompressed chunks (``finish``). ``tokens``: the session's ids,
    (num_tokens,) uint32; ``digests``, ``tail_digest``: as the header states them."""

    def __init__(self, spec: LayoutSpec, tokens: np.ndarray, tables: Sequence[bytes],
                 digests: Sequence[bytes], tail_digest: bytes) -> None:
        blocks = len(digests) + (1 if tail_digest else 0)
        if len(digests) != len(tokens) // spec.chunk_tokens:
            raise DataLoss(f"the header states {len(digests)} chunk digests for "
                           f"{len(tokens)} tokens in chunks of {spec.chunk_tokens}")
        if len(tables) != blocks:
            raise DataLoss(f"the header has {len(tables)} chunk tables for {len(digests)} "
                           f"chunks{' and a tail' if tail_digest else ''}")
        self.spec = spec
        self.chunks = len(digests)
        self.tables = [bytes(t) for t in tables]
        self.digests = [*digests, *([tail_digest] if tail_digest else [])]
        self.headers = [self._header(i, t, tokens) for i, t in enumerate(self.tables)]
        self.rows = [_rows(h) for h in self.headers]
        # the parts of each uncompressed chunk, for its digest; None: zstd (not checkable)
        self.kept: list[dict[tuple[int, int, int], bytes] | None] = [
            None if h.compressed else {} for h in self.headers]
        self._order = section_order(spec, blocks)

    def _header(self, index: int, table: bytes, tokens: np.ndarray) -> ChunkHeader:
        tail = index == self.chunks
        what = "the tail" if tail else f"chunk {index}"
        start = index * self.spec.chunk_tokens
        try:
            header = read_table(table)
            plan_for(header, self.spec)
        except (CodecError, InvalidRequest) as exc:
            raise ChunkCorrupt(f"the table of {what} does not check out: {exc}") from exc
        count = header.num_tokens if tail else self.spec.chunk_tokens
        if header.ephemeral or header.start_token != start or header.num_tokens != count \
                or not 0 < count <= len(tokens) - start \
                or header.tokens_hash != tokens_hash(tokens[start:start + count]):
            raise ChunkCorrupt(f"the table of {what} is not that of this session's tokens "
                               f"{start}+{count}")
        return header

    def add(self, stream: str, layer: int, chunk_index: int, codes: bytes, scales: bytes,
            codes_xxh3: int, scales_xxh3: int) -> None:
        """One ``LayerSection``: ``ChunkCorrupt`` unless it is the next one due and its
        parts are the bytes its chunk's table describes."""
        due = next(self._order, None)
        if due is None or due[1:] != (stream, layer, chunk_index):
            expected = "none" if due is None else f"{due[1]} layer {due[2]} chunk {due[3]}"
            raise ChunkCorrupt(f"section {stream} layer {layer} chunk {chunk_index} came "
                               f"out of order; the next due is {expected}")
        index = due[0]
        rows, kept = self.rows[chunk_index], self.kept[chunk_index]
        for part, data, stated in ((0, codes, codes_xxh3), (1, scales, scales_xxh3)):
            row = rows.get((index, layer, part))
            length, checksum = row if row is not None else (0, EMPTY_XXH3)
            if len(data) != length or stated != checksum or \
                    xxhash.xxh3_64_intdigest(data) != checksum:
                raise ChunkCorrupt(f"section {stream} layer {layer} chunk {chunk_index} "
                                   f"part {part} is not the bytes its chunk's table describes")
            if kept is not None and row is not None:
                kept[(index, layer, part)] = data

    def finish(self) -> None:
        """Every section came; each uncompressed chunk has the digest its spill stated
        (``DataLoss`` names the first that does not)."""
        due = next(self._order, None)
        if due is not None:
            raise ChunkCorrupt(f"the restore ended before section {due[1]} layer {due[2]} "
                               f"chunk {due[3]}")
        for i, (table, header, kept) in enumerate(zip(self.tables, self.headers, self.kept,
                                                      strict=True)):
            if kept is None:
                continue
            payload = b"".join(kept[(s, layer, p)] for s, layer, p in
                               zip(header.sections["stream"].tolist(),
                                   header.sections["layer"].tolist(),
                                   header.sections["part"].tolist(), strict=True))
            if chunk_digest(table + payload) != self.digests[i]:
                what = "the tail" if i == self.chunks else f"chunk {i}"
                raise DataLoss(f"restored {what} does not have the digest it was spilled "
                               "with")


def _rows(header: ChunkHeader) -> dict[tuple[int, int, int], tuple[int, int]]:
    rows = header.sections
    keys = zip(rows["stream"].tolist(), rows["layer"].tolist(), rows["part"].tolist(),
               strict=True)
    return dict(zip(keys, zip(rows["length"].tolist(), rows["checksum"].tolist(),
                              strict=True), strict=True))
