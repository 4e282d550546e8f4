"""A run of consecutive persistent chunks (a session's, in token order): ``PackedRun``, chunks
back to back in one buffer as a restore reply lies in shared memory, and ``decode_chunks``,
which decodes a run straight into one tensor per stream and part.

The run is checked as a whole, with no Python step per chunk: consecutive chunks of one size
are one (chunks, bytes) array (a view of a ``PackedRun``'s buffer, else of one join of them),
every header and section table is read from it as one numpy structured array and compared
with the layout's table once per token count, each chunk's header, token ids and payload are
hashed row by row, and each part of the result is one strided copy per slab of a group (the
payloads of a slab hashed just before it is copied, so each byte comes from memory once).
Anything the run check does not accept (a version 1 chunk, any fault) is decoded chunk by
chunk, which raises the first bad chunk's specific error. A ``PackedRun`` loads no torch;
decoding does.

    streams = decode_chunks(bufs, spec, token_ids, counts)  # {name: StreamData (layers, E, ...)}
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
import xxhash

from kvstore.format import run_buffers
from kvstore.format.chunk import (
    FLAG_ZSTD,
    HEADER_DTYPE,
    MAGIC,
    SECTION_DTYPE,
    VERSION,
    Buffer,
    StreamData,
    checked_plan,
    decoded_payload,
    tokens_hash,
    verify_payload,
)
from kvstore.format.chunk_parts import PART_CODES, PART_SCALES, chunk_plan, tensor_scale_fault
from kvstore.format.errors import ChunkCorrupt, InvalidRequest, LayoutMismatch
from kvstore.format.layout import LayoutSpec
from kvstore.format.zstd_frame import decompressed

# Chunks laid out alike, back to back: (k, bytes per chunk) uint8, payload offset in a
# row, tokens per chunk, and the payloads' checksums (k,) uint64 where they are still to
# be checked (as they are copied), else None.
Group = tuple[np.ndarray, int, int, np.ndarray | None]
# Rows are checked and copied out this many bytes at a time, so each is read from memory
# once and hashed and copied from cache.
SLAB_BYTES = 1 << 20
# Chunks at least this large are read from where they lie, one group each; smaller ones
# are joined first (unless packed), so a group of them is one array.
JOIN_BELOW = 1 << 18
_ALIGN = 64


class PackedRun(Sequence[memoryview]):
    """Chunks back to back in one buffer: chunk i is ``buffer[offsets[i]:offsets[i] +
    lengths[i]]``. A sequence of those views to every other reader; ``decode_chunks``
    reads the run from the buffer without joining it first."""

    def __init__(self, buffer: Buffer, lengths: Sequence[int]) -> None:
        self.buffer = np.frombuffer(buffer, np.uint8)  # (bytes,) uint8
        self.lengths = np.asarray(lengths, np.int64).reshape(-1)
        self.offsets = np.zeros(len(self.lengths), np.int64)
        np.cumsum(self.lengths[:-1], out=self.offsets[1:])
        if len(self.lengths) and (self.lengths.min() < 0
                                  or self.offsets[-1] + self.lengths[-1] > len(self.buffer)):
            raise InvalidRequest(f"{self.lengths.sum()} B of chunks do not fit a "
                                 f"{len(self.buffer)} B buffer")

    def __len__(self) -> int:
        return len(self.lengths)

    @overload
    def __getitem__(self, index: int) -> memoryview: ...

    @overload
    def __getitem__(self, index: slice) -> list[memoryview]: ...

    def __getitem__(self, index: int | slice) -> memoryview | list[memoryview]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        at = int(self.offsets[index])
        return self.buffer[at:at + int(self.lengths[index])].data

    def __iter__(self) -> Iterator[memoryview]:
        return map(self.__getitem__, range(len(self)))

    def followed_by(self, tail: Buffer) -> PackedRun | None:
        """This run with ``tail`` as one more chunk when ``tail`` lies right after it in
        the same buffer (as a restore reply's tail follows its chunks); else None."""
        view = np.frombuffer(tail, np.uint8)
        end = int(self.offsets[-1] + self.lengths[-1]) if len(self) else 0
        here = self.buffer.__array_interface__["data"][0] + end
        if (not view.size or end + view.size > len(self.buffer)
                or view.__array_interface__["data"][0] != here):
            return None
        return PackedRun(self.buffer.data, [*self.lengths.tolist(), view.size])


def decode_chunks(bufs: Sequence[Buffer], spec: LayoutSpec,
                  token_ids: Sequence[int] | np.ndarray, counts: Sequence[int]
                  ) -> dict[str, StreamData]:
    """Every persistent stream of the chunks ``bufs``, concatenated along entries: codes
    (layers, E, *codes_shape) and scales (layers, E, scales_per_entry), E the entries of
    all the chunks (fp8: scales (layers, len(bufs)) float32, chunk i's in column i).
    Chunk i must hold the ``counts[i]`` tokens after those of the chunks before it (the
    first starts at token 0), encoded for those of ``token_ids``; else
    InvalidRequest (the wrong chunks) or LayoutMismatch (other tokens or layout). Every
    byte read is verified, as by ``decode_chunk``: a bad chunk raises its CodecError."""
    if len(bufs) != len(counts):
        raise InvalidRequest(f"{len(bufs)} chunks but {len(counts)} token counts")
    ids = np.asarray(token_ids)
    groups = _checked_run(bufs, spec, ids, counts)
    if groups is not None:
        got = _assemble(spec, groups)
        if got is not None:
            return got
    streams = _assemble(spec, _checked_each(bufs, spec, ids, counts))
    if streams is None:
        raise ChunkCorrupt("a payload checksum mismatch in the chunks")
    return streams


@functools.lru_cache(maxsize=64)
def _run_header_dtype(sections: int) -> np.dtype:
    """Header, section table and header checksum of a version 2 chunk of ``sections``."""
    return np.dtype([("head", HEADER_DTYPE), ("table", SECTION_DTYPE, (sections,)),
                     ("check", "<u8")])


def _row_hashes(rows: np.ndarray) -> np.ndarray:
    """(k, bytes) uint8 -> (k,) uint64: xxh3-64 of each row, with no Python loop."""
    return np.fromiter(map(xxhash.xxh3_64_intdigest, rows), np.uint64, len(rows))


def _blocks(bufs: Sequence[Buffer], lens: np.ndarray, want: np.ndarray) -> list[np.ndarray]:
    """The run as (k, bytes) uint8 arrays of consecutive chunks of one size and token
    count: views of a ``PackedRun``'s buffer, or of one join of small chunks; large
    chunks one array each, where they lie."""
    n = len(lens)
    if isinstance(bufs, PackedRun):
        whole, offsets = bufs.buffer, bufs.offsets
    elif lens.max() < JOIN_BELOW:
        whole = np.frombuffer(b"".join(bufs), np.uint8)
        offsets = np.zeros(n, np.int64)
        np.cumsum(lens[:-1], out=offsets[1:])
    else:
        return [np.frombuffer(buf, np.uint8).reshape(1, -1) for buf in bufs]
    cuts = np.flatnonzero((lens[1:] != lens[:-1]) | (want[1:] != want[:-1])) + 1
    bounds = [0, *cuts.tolist(), n]
    return [whole[offsets[a]:offsets[a] + (b - a) * lens[a]].reshape(b - a, lens[a])
            for a, b in zip(bounds, bounds[1:], strict=False)]


def _checked_run(bufs: Sequence[Buffer], spec: LayoutSpec, ids: np.ndarray,
                 counts: Sequence[int]) -> list[Group] | None:
    """The run's groups once every check passed, all chunks at once; None when any
    check fails or a chunk is not version 2 (the chunk-by-chunk path then decides)."""
    n = len(bufs)
    nsec = len(chunk_plan(spec, spec.chunk_tokens, False).table_head)  # any count's
    dtype = _run_header_dtype(nsec)
    size = dtype.itemsize
    lens = (bufs.lengths if isinstance(bufs, PackedRun)
            else np.fromiter((memoryview(b).nbytes for b in bufs), np.int64, n))
    want = np.asarray(counts, np.int64).reshape(n)
    if n == 0 or lens.min() < size or want.min() < 0 or want.max() > spec.chunk_tokens:
        return None
    total = int(want.sum())
    if ids.ndim != 1 or len(ids) < total:
        return None
    ids = ids[:total]
    if total and ids.dtype != np.uint32 and (ids.min() < 0 or ids.max() > 0xFFFFFFFF):
        return None  # token_bytes refuses them: the chunk-by-chunk path says where
    tokens = np.ascontiguousarray(ids, "<u4").view(np.uint8)  # (4 * total,) uint8
    blocks = _blocks(bufs, lens, want)
    firsts = np.zeros(n, np.int64)
    np.cumsum(want[:-1], out=firsts[1:])
    raw = np.concatenate([block[:, :size] for block in blocks])  # (n, size) uint8
    heads = raw.view(dtype).reshape(n)
    head = heads["head"]
    zstd = (head["flags"] & FLAG_ZSTD) != 0
    ok = ((head["magic"] == MAGIC) & (head["version"] == VERSION)
          & ((head["flags"] & ~np.uint16(FLAG_ZSTD)) == 0)  # persistent, no unknown flag
          & (head["layout_hash"] == spec.layout_hash) & (head["start_token"] == firsts)
          & (head["num_tokens"] == want) & (head["sections"] == nsec)
          & (lens == size + head["stored_len"].astype(np.int64))
          & (zstd | (head["stored_len"] == head["raw_len"])))
    if not ok.all() or not (_row_hashes(raw[:, :size - 8]) == heads["check"]).all():
        return None
    rows = heads["table"].view(np.uint64).reshape(n, nsec, 4)[:, :, :3]
    at = 0
    for block in blocks:  # each of one token count
        k, first, count = len(block), int(firsts[at]), int(want[at])
        plan = chunk_plan(spec, count, False)
        # the table is exactly the layout's for the token count; then the token ids, and
        # the payload as stored, compressed or not (version 2's checksum)
        mine = tokens[4 * first:4 * (first + k * count)].reshape(k, 4 * count)
        stored = zstd[at:at + k].any()  # uncompressed: checked as it is copied
        if not ((rows[at:at + k] == plan.table_head).all()
                and (head["raw_len"][at:at + k] == plan.payload_bytes).all()
                and (_row_hashes(mine) == head["tokens_hash"][at:at + k]).all()
                and (not stored or (_row_hashes(block[:, size:])
                                    == head["payload_checksum"][at:at + k]).all())):
            return None
        at += k
    groups: list[Group] = []
    at = 0
    for block in blocks:
        k, count = len(block), int(want[at])
        if not zstd[at:at + k].any():
            groups.append((block, size, count, head["payload_checksum"][at:at + k]))
        else:
            groups += [(decompressed(row[size:], int(head["raw_len"][at + i])).reshape(1, -1),
                        0, count, None) for i, row in enumerate(block)]
        at += k
    return groups


def _checked_each(bufs: Sequence[Buffer], spec: LayoutSpec, ids: np.ndarray,
                  counts: Sequence[int]) -> list[Group]:
    """The run checked chunk by chunk, each chunk its own group: the first bad chunk
    raises its own error."""
    groups: list[Group] = []
    start = 0
    for buf, count in zip(bufs, counts, strict=True):
        view = memoryview(buf).cast("B")
        header, _ = checked_plan(view, spec, None)
        if header.ephemeral or header.start_token != start or header.num_tokens != count:
            raise InvalidRequest(f"expected the persistent chunk of tokens {start}.."
                                 f"{start + count - 1}, got one of {header.num_tokens} "
                                 f"tokens from {header.start_token}")
        mine = ids[start:start + count]
        if len(mine) != count or tokens_hash(mine) != header.tokens_hash:
            raise LayoutMismatch(f"chunk of tokens {start}..{start + count - 1} was encoded "
                                 "for other token ids")
        payload = decoded_payload(view, header, copy=False)  # assembled below: one copy
        verify_payload(view, header, payload)
        groups.append((payload.reshape(1, -1), 0, count, None))
        start += count
    return groups


def _assemble(spec: LayoutSpec, groups: list[Group]) -> dict[str, StreamData] | None:
    """Each part of the run as one tensor: per slab of a group's chunks, their payload
    checksums checked (where still to be), then one strided copy per part of the slab's
    (chunk, layer, bytes) into (layer, chunk, bytes) of the result; None when a checksum
    fails (nothing of the result is returned). Every part is a view of one block of
    ``run_buffers`` (memory of earlier decodes, reused: fresh pages fault in one by one)."""
    import torch

    plans = [(block, base, chunk_plan(spec, count, False).parts, sums)
             for block, base, count, sums in groups]
    parts0 = chunk_plan(spec, 0, False).parts
    sizes = [sum(len(block) * got[index].layer_bytes for block, _, got, _ in plans)
             * p.stream.layers for index, p in enumerate(parts0)]
    starts = [0]
    for size in sizes:  # each part 64-byte aligned, for any dtype's view
        starts.append(starts[-1] + -(-size // _ALIGN) * _ALIGN)
    whole = run_buffers.take(starts[-1] + _ALIGN)
    skip = (-whole.ctypes.data) % _ALIGN
    outs = [whole[skip + starts[i]:skip + starts[i] + sizes[i]].reshape(p.stream.layers, -1)
            for i, p in enumerate(parts0)]  # each (layers, bytes) uint8
    cols = [0] * len(parts0)
    for block, base, got, sums in plans:
        step = max(1, SLAB_BYTES // max(1, block.shape[1]))
        for a in range(0, len(block), step):
            rows = block[a:a + step]
            if sums is not None and not (_row_hashes(rows[:, base:]) == sums[a:a + step]).all():
                return None
            for index, out in enumerate(outs):
                k, span, layers = len(rows), got[index].layer_bytes, out.shape[0]
                at = base + got[index].offset
                src = rows[:, at:at + layers * span].reshape(k, layers, span)
                col = cols[index]
                out[:, col:col + k * span].reshape(layers, k, span)[...] = src.transpose(1, 0, 2)
                cols[index] = col + k * span
    parts: dict[str, dict[int, torch.Tensor]] = {}  # stream -> part -> tensor
    for p, out in zip(parts0, outs, strict=True):
        layers, shape = p.stream.layers, p.shape[2:]
        if out.size:
            tensor = torch.from_numpy(out).view(p.dtype).reshape(layers, -1, *shape)
        else:  # no entry (a view of nothing has no usable stride)
            tensor = torch.empty((layers, 0, *shape), dtype=p.dtype)
        if p.part == PART_SCALES and p.stream.value_format.scales == "tensor":
            fault = tensor_scale_fault(p.stream.name, tensor.numpy())  # (layers, chunks)
            if fault:
                raise ChunkCorrupt(fault)
        parts.setdefault(p.stream.name, {})[p.part] = tensor
    return {name: StreamData(got[PART_CODES], got.get(PART_SCALES))
            for name, got in parts.items()}
