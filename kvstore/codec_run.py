"""Decode a run of consecutive persistent chunks (a session's, in token order) straight into
one tensor per stream and part.

``decode_chunk`` builds a dict of tensors per chunk, which costs about 100 µs of Python
and torch calls whatever the chunk's size; a 64k-token session of the bundled layout has
128 chunks of 18 KB. Here each chunk costs only its checks and checksums, its sections
are numpy views, and each part of the result is assembled with one copy.

    streams = decode_chunks(bufs, spec, token_ids, counts)  # {name: StreamData (layers, E, ...)}
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore.chunk_plan import PART_CODES, PART_SCALES, chunk_plan
from kvstore.codec import (
    StreamData,
    checked_plan,
    decoded_payload,
    tokens_hash,
    verify_sections,
)
from kvstore.errors import InvalidRequest, LayoutMismatch
from kvstore.layout import LayoutSpec

Buffer = bytes | bytearray | memoryview


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
    # (stream index, part) -> per chunk (layers, bytes of its entries) uint8 views
    pieces: dict[tuple[int, int], list[np.ndarray]] = {}
    start = 0
    for buf, count in zip(bufs, counts, strict=True):
        view = memoryview(buf).cast("B")
        header, plan = checked_plan(view, spec, None)
        if header.ephemeral or header.start_token != start or header.num_tokens != count:
            raise InvalidRequest(f"expected the persistent chunk of tokens {start}.."
                                 f"{start + count - 1}, got one of {header.num_tokens} "
                                 f"tokens from {header.start_token}")
        mine = ids[start:start + count]
        if len(mine) != count or tokens_hash(mine) != header.tokens_hash:
            raise LayoutMismatch(f"chunk of tokens {start}..{start + count - 1} was encoded "
                                 "for other token ids")
        payload = decoded_payload(view, header, copy=False)  # concatenated below: one copy
        verify_sections(payload, header.sections)
        for p in plan.parts:
            size = p.layer_bytes * p.stream.layers
            rows = payload[p.offset:p.offset + size].reshape(p.stream.layers, p.layer_bytes)
            pieces.setdefault((p.stream_index, p.part), []).append(rows)
        start += count
    # every part's dtype and per-entry shape, as the chunk plan lays them out
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for p in chunk_plan(spec, 0, False).parts:
        layers, shape = p.stream.layers, p.shape[2:]
        rows = pieces.get((p.stream_index, p.part), [])
        joined = np.concatenate(rows, axis=1) if rows else np.empty((layers, 0), np.uint8)
        if joined.size:
            tensor = torch.from_numpy(joined).view(p.dtype).reshape(layers, -1, *shape)
        else:  # no entry (a view of nothing has no usable stride)
            tensor = torch.empty((layers, 0, *shape), dtype=p.dtype)
        parts.setdefault(p.stream.name, {})[p.part] = tensor
    return {name: StreamData(got[PART_CODES], got.get(PART_SCALES))
            for name, got in parts.items()}
