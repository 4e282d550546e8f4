"""The sessions the conformance checks spill: their layouts, and chunk bytes built from
random payloads with ``kvstore.format``'s encoder (no torch: the server stores bytes and
never reads their values, and every bit pattern is a valid code or scale).

Payloads: (layers, entries, *codes_shape) codes then (layers, entries, groups) fp16
scales per stream, as ``chunk_plan`` orders them; here random bytes of that length.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvstore.format.checks import pending_counts
from kvstore.format.chunk import encode_raw
from kvstore.format.chunk_parts import chunk_plan
from kvstore.format.keys import chain_keys, chunk_digest, dedupe_scope
from kvstore.format.layout import LayoutSpec, Stream
from proto import kvtier_pb2 as pb

# Every kind of stream (int4 with m = 2, int8, bf16; window K/V and pending rows), four
# tokens a chunk, W = 4: a session of 11 tokens has 2 chunks, a tail of 3, 1 pending row.
# The same streams as the golden vectors' `wire-test` layout (tests/vectors/generate.py).
EVERY_KIND = (
    Stream("a.int4", (2, 8), bits=4, group_size=8, tokens_per_entry=2, layers=2),
    Stream("b.int8", (8,), bits=8, group_size=4, layers=1),
    Stream("c.bf16", (4,), bits=16, layers=1),
    Stream("w.window", (4,), bits=8, group_size=4, layers=1, persistent=False),
    Stream("p.pending", (4,), bits=16, layers=1, persistent=False, pending=True),
)
LAYOUT = LayoutSpec("kvtier-conformance", EVERY_KIND, chunk_tokens=4, vocab_size=1 << 17,
                    window_tokens=4, notes="python -m kvtier.conformance")
# One chunk of 5 MiB (a bf16 stream of 1,024 values, 2,560 tokens): over gRPC's default
# 4 MiB receive limit, within the server's default 8 MiB message limit.
LARGE = LayoutSpec(
    name="kvtier-conformance-large",
    streams=(Stream("k", (1024,), bits=16, layers=1),),
    chunk_tokens=2560,
    notes="python -m kvtier.conformance: the receive limit",
)
_V2 = struct.Struct("<4sHHQQIIQQQQ")
_V1 = struct.Struct("<4sHHQQIIQQQ")


@dataclass
class Session:
    """A session's encoded parts: ``raw`` holds each chunk's (then the tail's) raw
    payload, what its sections hold back to back."""

    spec: LayoutSpec
    tokens: np.ndarray  # (num_tokens,) uint32
    chunks: list[bytes]
    keys: list[str]
    digests: list[bytes]
    tail: bytes
    window: bytes | None
    raw: list[bytes]

    def header(self, ref: pb.SessionRef, generation: int = 1, **changes: Any
               ) -> pb.SpillHeader:
        fields: dict[str, Any] = dict(
                      session=ref, layout_id=self.spec.layout_id, generation=generation,
                      token_ids=self.tokens.tobytes(), chunk_keys=self.keys,
                      chunk_digests=self.digests,
                      tail_digest=chunk_digest(self.tail) if self.tail else b"",
                      window_digest=chunk_digest(self.window) if self.window else b"")
        fields.update(changes)
        return pb.SpillHeader(**fields)

    def messages(self, header: pb.SpillHeader, *, send: set[int] | None = None
                 ) -> list[pb.SpillRequest]:
        """The Spill stream: the header, the chunks (those in ``send``; default all), the
        tail and the window."""
        out = [pb.SpillRequest(header=header)]
        out += [pb.SpillRequest(chunk=pb.Payload(key=key, data=data))
                for i, (key, data) in enumerate(zip(self.keys, self.chunks, strict=True))
                if send is None or i in send]
        if self.tail:
            out.append(pb.SpillRequest(tail=pb.Payload(data=self.tail)))
        if self.window:
            out.append(pb.SpillRequest(window=pb.Payload(data=self.window)))
        return out


def build(spec: LayoutSpec, num_tokens: int, tenant: str, seed: int | tuple[int, ...], *,
          zstd_level: int | None = None, window: bool = True,
          pending: int | None = None) -> Session:
    """A session of random tokens and payloads; ``pending``: the pending rows' token
    count (default: what the layout gives, ``pending_counts``)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, min(spec.vocab_size, 1 << 31), num_tokens).astype("<u4")
    size = spec.chunk_tokens
    spans = [(i * size, (i + 1) * size) for i in range(num_tokens // size)]
    if num_tokens % size:
        spans.append((num_tokens - num_tokens % size, num_tokens))
    raw = [rng.bytes(chunk_plan(spec, b - a, False).payload_bytes) for a, b in spans]
    encoded = [encode_raw(spec, a, tokens[a:b], payload, zstd_level=zstd_level)
               for (a, b), payload in zip(spans, raw, strict=True)]
    full = num_tokens // size
    blob = _window(spec, tokens, rng, pending) if window and spec.ephemeral_streams else None
    return Session(spec, tokens, encoded[:full],
                   chain_keys(spec.layout_id, tokens, size, scope=dedupe_scope(tenant)),
                   [chunk_digest(c) for c in encoded[:full]],
                   encoded[full] if len(encoded) > full else b"", blob, raw)


def _window(spec: LayoutSpec, tokens: np.ndarray, rng: np.random.Generator,
            pending: int | None) -> bytes:
    """Window K/V over the last min(W, n) tokens, then the pending rows."""
    n = len(tokens)
    if pending is None:
        pending = max(pending_counts(spec, n), default=0)
    parts = []
    for names, covered in (
            (tuple(s.name for s in spec.ephemeral_streams if not s.pending),
             min(spec.window_tokens, n)),
            (tuple(s.name for s in spec.ephemeral_streams if s.pending), pending)):
        if names and covered:
            plan = chunk_plan(spec, covered, True, names)
            parts.append(encode_raw(spec, n - covered, tokens[n - covered:],
                                    rng.bytes(plan.payload_bytes), ephemeral=True,
                                    names=names))
    return b"".join(parts)


def as_version_1(chunk: bytes) -> bytes:
    """The same chunk in format version 1 (docs/wire-format.md 2.1): the header without
    ``payload_checksum``, the check recomputed."""
    fields = _V2.unpack_from(chunk)
    sections = fields[6]
    head = _V1.pack(fields[0], 1, *fields[2:-1])
    table = chunk[_V2.size:_V2.size + 32 * sections]
    body = head + table
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + \
        chunk[_V2.size + 32 * sections + 8:]
