"""Honest sessions of the bundled layout for the fuzz and adversarial campaigns:
token ids, random KV encoded as the client encodes it (chunks, tail, window), and the
raw Spill messages that state them for any tenant.

Each token sequence comes in two KV variants ("a", "b"): the same tokens with other
bytes, which is what an attacker who knows a victim's prompt sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.format.keys import chain_keys, chunk_digest, dedupe_scope
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import get_layout
from proto import kvtier_pb2 as pb

LAYOUT = get_layout("kvtier-bundled")


@dataclass(frozen=True)
class Encoded:
    tokens: np.ndarray  # (n,) <u4
    chunks: tuple[bytes, ...]
    tail: bytes
    window: bytes | None

    def keys(self, tenant: str, *, domain: str = "", fingerprint: str = "") -> list[str]:
        return chain_keys(LAYOUT.layout_id, self.tokens, LAYOUT.chunk_tokens,
                          scope=dedupe_scope(tenant, domain or None),
                          model_fingerprint=fingerprint)

    def header(self, tenant: str, session_id: str, generation: int, **changes
               ) -> pb.SpillHeader:
        """The header an honest client sends for this session; ``changes`` override."""
        fields = dict(session=pb.SessionRef(tenant=tenant, session_id=session_id),
                      layout_id=LAYOUT.name, generation=generation,
                      token_ids=self.tokens.tobytes(), chunk_keys=self.keys(tenant),
                      chunk_digests=[chunk_digest(c) for c in self.chunks],
                      tail_digest=chunk_digest(self.tail) if self.tail else b"",
                      window_digest=chunk_digest(self.window) if self.window else b"")
        fields.update(changes)
        return pb.SpillHeader(**fields)

    def spill(self, tenant: str, session_id: str, generation: int, *, window: bool = True,
              **changes) -> list[pb.SpillRequest]:
        """Every message of an honest Spill of this session."""
        header = self.header(tenant, session_id, generation, **changes)
        if not window:
            header.window_digest = b""
        out = [pb.SpillRequest(header=header)]
        out += [pb.SpillRequest(chunk=pb.Payload(key=key, data=data))
                for key, data in zip(header.chunk_keys, self.chunks, strict=False)]
        if self.tail:
            out.append(pb.SpillRequest(tail=pb.Payload(data=self.tail)))
        if window and self.window:
            out.append(pb.SpillRequest(window=pb.Payload(data=self.window)))
        return out


def random_streams(spec: LayoutSpec, tokens: int, seed: int, streams=None) -> dict:
    """Random codes and scales for ``streams`` (default: the persistent ones) over
    ``tokens`` tokens, shaped as the client takes them."""
    import torch

    from kvstore.format.chunk import StreamData
    from kvstore.format.chunk_parts import code_dtype

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for s in spec.persistent_streams if streams is None else streams:
        shape = (s.layers, s.entries_for(tokens), *s.codes_shape)
        if s.bits == 16:
            codes = torch.randn(shape, generator=gen).to(code_dtype(s))
        else:
            low, high = (-128, 128) if s.bits == 8 else (0, 256)
            codes = torch.randint(low, high, shape, generator=gen,
                                  dtype=torch.int16).to(code_dtype(s))
        scales = None if s.bits == 16 else torch.rand(
            (s.layers, s.entries_for(tokens), s.scales_per_entry), generator=gen
        ).to(torch.float16)
        out[s.name] = StreamData(codes, scales)
    return out


def encode(tokens: np.ndarray, seed: int, *, window: bool = True) -> Encoded:
    """A session of these tokens with random KV from ``seed`` (and a window over the
    last W tokens, with the pending rows of an unfinished entry)."""
    from kvtier.codec import encode_session, encode_window

    spec = LAYOUT
    enc = encode_session(spec, tokens, random_streams(spec, len(tokens), seed),
                         scope=dedupe_scope("any"))  # the bytes do not depend on the scope
    blob = None
    if window:
        m = max(s.tokens_per_entry for s in spec.persistent_streams)
        covered = min(spec.window_tokens, len(tokens))
        streams = random_streams(spec, covered, seed + 1,
                                 [s for s in spec.ephemeral_streams if not s.pending])
        if len(tokens) % m:
            streams |= random_streams(spec, len(tokens) % m, seed + 2,
                                      [s for s in spec.ephemeral_streams if s.pending])
        blob = encode_window(spec, tokens, streams)
    return Encoded(tokens, tuple(enc.chunks[i] for i in range(len(enc.keys))), enc.tail, blob)


def token_ids(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, LAYOUT.vocab_size, count, dtype="<u4")


def build_pool(seed: int = 0) -> dict[tuple[int, str], Encoded]:
    """(sequence index, variant) -> session: four token sequences (one and two chunks
    with a tail, exactly one chunk, a tail alone), each in KV variants "a" and "b"."""
    c = LAYOUT.chunk_tokens
    lengths = (c + 40, 2 * c + 7, c, 100)
    pool = {}
    for i, n in enumerate(lengths):
        tokens = token_ids(n, seed * 100 + i)
        for j, variant in enumerate("ab"):
            pool[i, variant] = encode(tokens, seed * 1000 + 10 * i + j)
    return pool
