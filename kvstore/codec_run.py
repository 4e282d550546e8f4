"""Decode a run of consecutive persistent chunks (a session's, in token order) straight into
one tensor per stream and part.

``decode_chunk`` builds a dict of tensors per chunk, which costs about 100 µs of Python
and torch calls whatever the chunk's size; a 64k-token session of the bundled layout has
128 chunks of 18 KB. Here the run is checked as a whole: the chunks are joined into one
buffer, every header and section table is parsed as one numpy structured array and
compared with the layout's table once per token count, each chunk costs three hashes
(header, token ids, payload: version 2 checksums the payload as one piece), and each
part of the result is one strided copy per group of equal chunks. Anything the run check
does not accept (a version 1 chunk, any fault) is decoded chunk by chunk, which verifies
every section and raises the first bad chunk's specific error.

    streams = decode_chunks(bufs, spec, token_ids, counts)  # {name: StreamData (layers, E, ...)}
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from operator import attrgetter, getitem

import numpy as np
import torch
import xxhash

from kvstore.chunk_plan import PART_CODES, PART_SCALES, chunk_plan
from kvstore.codec import (
    FLAG_ZSTD,
    HEADER_DTYPE,
    MAGIC,
    SECTION_DTYPE,
    VERSION,
    StreamData,
    checked_plan,
    decoded_payload,
    decompressed,
    tokens_hash,
    verify_payload,
)
from kvstore.errors import InvalidRequest, LayoutMismatch
from kvstore.keys import token_bytes
from kvstore.layout import LayoutSpec

Buffer = bytes | bytearray | memoryview
# Chunks laid out alike, back to back: (k, bytes per chunk) uint8, payload offset in a
# row, tokens per chunk.
Group = tuple[np.ndarray, int, int]
# Chunks at least this large are copied from where they lie, one group each; smaller ones
# are joined first, so a group of them is copied with one strided call per part.
JOIN_BELOW = 1 << 18


def decode_chunks(bufs: Sequence[Buffer], spec: LayoutSpec,
                  token_ids: Sequence[int] | np.ndarray, counts: Sequence[int]
                  ) -> dict[str, StreamData]:
    """Every persistent stream of the chunks ``bufs``, concatenated along entries: codes
    (layers, E, *codes_shape) and scales (layers, E, scales_per_entry), E the entries of
    all the chunks. Chunk i must hold the ``counts[i]`` tokens after those of the chunks
    before it (the first starts at token 0), encoded for those of ``token_ids``; else
    InvalidRequest (the wrong chunks) or LayoutMismatch (other tokens or layout). Every
    byte read is verified, as by ``decode_chunk``: a bad chunk raises its CodecError."""
    if len(bufs) != len(counts):
        raise InvalidRequest(f"{len(bufs)} chunks but {len(counts)} token counts")
    ids = np.asarray(token_ids)
    groups = _checked_run(bufs, spec, ids, counts)
    if groups is None:
        groups = _checked_each(bufs, spec, ids, counts)
    return _assemble(spec, groups)


@functools.lru_cache(maxsize=64)
def _run_header_dtype(sections: int) -> np.dtype:
    """Header, section table and header checksum of a version 2 chunk of ``sections``."""
    return np.dtype([("head", HEADER_DTYPE), ("table", SECTION_DTYPE, (sections,)),
                     ("check", "<u8")])


def _hashes(views: Sequence[memoryview], starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """xxh3-64 of each ``views[i][starts[i]:ends[i]]``, with no Python loop."""
    pieces = map(getitem, views, map(slice, starts.tolist(), ends.tolist()))
    return np.fromiter(map(xxhash.xxh3_64_intdigest, pieces), np.uint64, len(starts))


def _checked_run(bufs: Sequence[Buffer], spec: LayoutSpec, ids: np.ndarray,
                 counts: Sequence[int]) -> list[Group] | None:
    """The run's groups once every check passed, all chunks at once; None when any
    check fails or a chunk is not version 2 (the chunk-by-chunk path then decides)."""
    n = len(bufs)
    nsec = len(chunk_plan(spec, spec.chunk_tokens, False).table_head)  # any count's
    dtype = _run_header_dtype(nsec)
    size = dtype.itemsize
    views = list(map(memoryview, bufs))
    lens = np.fromiter(map(attrgetter("nbytes"), views), np.int64, n)
    want = np.asarray(counts, np.int64).reshape(n)
    if n == 0 or lens.min() < size or want.min() < 0 or want.max() > spec.chunk_tokens:
        return None
    heads = np.frombuffer(b"".join(map(getitem, views, itertools.repeat(slice(0, size), n))),
                          dtype)
    head = heads["head"]
    first = np.zeros(n, np.int64)
    np.cumsum(want[:-1], out=first[1:])
    total = int(want.sum())
    zstd = (head["flags"] & FLAG_ZSTD) != 0
    ok = ((head["magic"] == MAGIC) & (head["version"] == VERSION)
          & ((head["flags"] & ~np.uint16(FLAG_ZSTD)) == 0)  # persistent, no unknown flag
          & (head["layout_hash"] == spec.layout_hash) & (head["start_token"] == first)
          & (head["num_tokens"] == want) & (head["sections"] == nsec)
          & (lens == size + head["stored_len"].astype(np.int64))
          & (zstd | (head["stored_len"] == head["raw_len"])))
    if not ok.all() or ids.ndim != 1 or len(ids) < total:
        return None
    if total and (ids[:total].min() < 0 or ids[:total].max() > 0xFFFFFFFF):
        return None  # token_bytes refuses them: the chunk-by-chunk path says where
    # the table is exactly the layout's for each chunk's token count
    rows = heads["table"].view(np.uint64).reshape(n, nsec, 4)[:, :, :3]
    for count in np.unique(want).tolist():
        plan, mine = chunk_plan(spec, count, False), want == count
        if not ((rows[mine] == plan.table_head).all()
                and (head["raw_len"][mine] == plan.payload_bytes).all()):
            return None
    zero = np.zeros(n, np.int64)
    if not (_hashes(views, zero, zero + size - 8) == heads["check"]).all():
        return None
    tokens = memoryview(token_bytes(ids[:total]))
    if not (_hashes(itertools.repeat(tokens, n), first * 4, (first + want) * 4)
            == head["tokens_hash"]).all():
        return None
    # the payload as stored, compressed or not (version 2's payload checksum)
    if not (_hashes(views, zero + size, lens) == head["payload_checksum"]).all():
        return None
    raws: dict[int, np.ndarray] = {}
    for i in np.flatnonzero(zstd).tolist():
        raws[i] = decompressed(views[i][size:], int(head["raw_len"][i]))
    groups: list[Group] = []
    at = 0
    for (count, packed), same in itertools.groupby(zip(want.tolist(), zstd.tolist(),
                                                       strict=True)):
        k, span = len(list(same)), int(lens[at])
        if packed:
            groups += [(raws[i].reshape(1, -1), 0, count) for i in range(at, at + k)]
        elif span >= JOIN_BELOW:
            groups += [(np.frombuffer(views[i], np.uint8).reshape(1, -1), size, count)
                       for i in range(at, at + k)]
        else:
            block = np.frombuffer(b"".join(views[at:at + k]), np.uint8).reshape(k, span)
            groups.append((block, size, count))
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
        groups.append((payload.reshape(1, -1), 0, count))
        start += count
    return groups


def _assemble(spec: LayoutSpec, groups: list[Group]) -> dict[str, StreamData]:
    """Each part of the run as one tensor: per group of chunks, one strided copy of the
    part's (chunk, layer, bytes) into (layer, chunk, bytes) of the result."""
    plans = [(block, base, chunk_plan(spec, count, False).parts) for block, base, count in groups]
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for index, p in enumerate(chunk_plan(spec, 0, False).parts):
        layers, shape = p.stream.layers, p.shape[2:]
        width = sum(len(block) * got[index].layer_bytes for block, _, got in plans)
        out = np.empty((layers, width), np.uint8)
        col = 0
        for block, base, got in plans:
            k, span = len(block), got[index].layer_bytes
            at = base + got[index].offset
            src = block[:, at:at + layers * span].reshape(k, layers, span)
            out[:, col:col + k * span].reshape(layers, k, span)[...] = src.transpose(1, 0, 2)
            col += k * span
        if out.size:
            tensor = torch.from_numpy(out).view(p.dtype).reshape(layers, -1, *shape)
        else:  # no entry (a view of nothing has no usable stride)
            tensor = torch.empty((layers, 0, *shape), dtype=p.dtype)
        parts.setdefault(p.stream.name, {})[p.part] = tensor
    return {name: StreamData(got[PART_CODES], got.get(PART_SCALES))
            for name, got in parts.items()}
