"""The reference model: what every session must hold, and the judgement of a reply.

A session's truth is its versions (generation, token ids, the exact persistent tensors,
the spilled window tensors, whether the ack was durable). Normally only the latest
counts; after a kill -9 any version from the last durable one on may come back (or
none, when no version was durable), until a restore shows which one did.

Tensors of a stream (``kvstore.format.chunk.StreamData``): codes ``(layers, entries,
*codes_shape)``, scales ``(layers, entries, groups)`` or None for 16-bit streams.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field

import torch

from kvstore.format.chunk import StreamData
from kvstore.format.layout import LayoutSpec
from stress.fuzz import pool


def random_streams(spec: LayoutSpec, tokens: int, rng: random.Random, streams=None
                   ) -> dict[str, StreamData]:
    """Random codes and scales for ``streams`` (default: the persistent ones), drawn
    from ``rng``'s sequence."""
    return pool.random_streams(spec, tokens, rng.getrandbits(62), streams)


def random_window(spec: LayoutSpec, tokens: int, rng: random.Random
                  ) -> dict[str, StreamData]:
    """Window K/V over the last min(W, tokens) tokens and the pending rows of the
    unfinished entry, as the bundled model keeps them."""
    m = max(s.tokens_per_entry for s in spec.persistent_streams)
    out = random_streams(spec, min(spec.window_tokens, tokens), rng,
                         [s for s in spec.ephemeral_streams if not s.pending])
    if tokens % m:
        out |= random_streams(spec, tokens % m, rng,
                              [s for s in spec.ephemeral_streams if s.pending])
    return out


def extended(spec: LayoutSpec, old: dict[str, StreamData], old_tokens: int, tokens: int,
             rng: random.Random) -> dict[str, StreamData]:
    """Streams over ``tokens`` whose whole entries of the first ``old_tokens`` are
    ``old``'s (a session that decoded further), the rest random."""
    fresh = random_streams(spec, tokens, rng)
    out = {}
    for s in spec.persistent_streams:
        keep = old_tokens // s.tokens_per_entry
        codes = fresh[s.name].codes.clone()
        codes[:, :keep] = old[s.name].codes[:, :keep]
        scales = fresh[s.name].scales
        if scales is not None:
            scales = scales.clone()
            scales[:, :keep] = old[s.name].scales[:, :keep]
        out[s.name] = StreamData(codes, scales)
    return out


def truncated(spec: LayoutSpec, streams: dict[str, StreamData], tokens: int
              ) -> dict[str, StreamData]:
    """The first ``tokens`` (a multiple of every stream's m) of ``streams``."""
    out = {}
    for s in spec.persistent_streams:
        e = s.entries_for(tokens)
        data = streams[s.name]
        out[s.name] = StreamData(data.codes[:, :e].clone(),
                                 None if data.scales is None else data.scales[:, :e].clone())
    return out


def digest(streams: dict[str, StreamData] | None) -> str:
    """12 hex digits over every stream's bytes: how findings name tensors."""
    if streams is None:
        return "none"
    h = hashlib.blake2b(digest_size=6)
    for name in sorted(streams):
        h.update(name.encode())
        h.update(streams[name].codes.contiguous().view(torch.uint8).numpy().tobytes())
        if streams[name].scales is not None:
            h.update(streams[name].scales.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def same_streams(a: dict[str, StreamData], b: dict[str, StreamData]) -> bool:
    """Equal tensors, stream by stream (a stream of no entries is no stream)."""
    a = {k: v for k, v in a.items() if v.codes.shape[1]}
    b = {k: v for k, v in b.items() if v.codes.shape[1]}
    if set(a) != set(b):
        return False
    for name in a:
        if a[name].codes.shape != b[name].codes.shape \
                or not torch.equal(a[name].codes, b[name].codes):
            return False
        if (a[name].scales is None) != (b[name].scales is None):
            return False
        if a[name].scales is not None and not torch.equal(a[name].scales, b[name].scales):
            return False
    return True


@dataclass
class Version:
    generation: int
    layout: str  # layout name
    tokens: torch.Tensor  # (n,) int64 token ids
    persistent: dict[str, StreamData]
    window: dict[str, StreamData] | None  # as spilled (exactly what a restore returns)
    durable: bool
    origin: str = ""  # the operation and step that made it: "spill-rewrite@31"

    def describe(self) -> str:
        return (f"gen {self.generation} n {len(self.tokens)} digest {digest(self.persistent)}"
                f" ({self.origin})")


@dataclass
class Held:
    """One session the model says exists."""

    tenant: str
    sid: str
    versions: list[Version]  # oldest first; the last is the latest acked
    uncertain: bool = False  # after kill -9, until a restore shows which version survived
    window_replayed: bool = False  # a replay built a window since the last spill
    ttl_s: float = 0.0
    touched: float = field(default_factory=time.monotonic)
    flagged: set[str] = field(default_factory=set)  # kinds of findings already recorded
    trail: list[str] = field(default_factory=list)  # origins since a restore last agreed
    model: str = ""  # the model fingerprint its spills state ("": none)

    @property
    def current(self) -> Version:
        return self.versions[-1]

    def candidates(self) -> list[Version]:
        if not self.uncertain:
            return [self.current]
        floor = max((i for i, v in enumerate(self.versions) if v.durable), default=0)
        return self.versions[floor:]

    def may_be_absent(self, now: float) -> bool:
        """Whether SessionNotFound is a documented answer now: expired (TTL, with a
        half-second margin for the server's clock of idleness), or lost with a kill -9
        before any version of it was durable."""
        if self.ttl_s and now > self.touched + self.ttl_s - 0.5:
            return True
        return self.uncertain and not any(v.durable for v in self.versions)

    def settle(self, version: Version) -> None:
        """A restore showed ``version``: it is the truth from now on."""
        self.versions = [version]
        self.uncertain = False
        self.trail = []

    def push(self, version: Version) -> None:
        """A newer version acked: kept with those a kill -9 may fall back to (from the
        last durable one on)."""
        self.versions.append(version)
        self.trail.append(version.origin)
        floor = max((i for i, v in enumerate(self.versions) if v.durable), default=0)
        self.versions = self.versions[floor:]
        self.window_replayed = False

    def drained(self) -> None:
        """A graceful stop wrote every acked version back: the latest is durable."""
        self.current.durable = True
        self.versions = [self.current]


def expected_coverage(spec: LayoutSpec, tokens: int, replay_tokens: int, default_r: int
                      ) -> int:
    """The fewest tokens a resumed window may cover: the replay asked for (else the
    layout's stated R, else the server's default), at most the window and the session."""
    return min(replay_tokens or spec.replay_tokens or default_r, spec.window_tokens, tokens)
