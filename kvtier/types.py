"""What the client returns, and how it retries: plain dataclasses, no gRPC."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.format.chunk import StreamData
from kvstore.format.layout import LayoutSpec


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_backoff_s
        for _ in range(self.attempts - 1):
            yield delay / 2 + random.uniform(0, delay / 2)  # "equal jitter"
            delay = min(delay * self.multiplier, self.max_backoff_s)


@dataclass(frozen=True)
class LayoutInfo:
    """A layout the server serves (ListLayouts, RegisterLayout)."""

    layout_id: str  # name@<16 hex digits>
    layout_json: str  # the canonical encoding (kvstore.format.layout.layout_to_json)
    replayer: str  # kvstore.format.layout.REPLAYERS: what can rebuild its window
    builtin: bool  # a shipped preset, not registered at run time
    spec: LayoutSpec  # layout_json parsed


@dataclass(frozen=True)
class SpillResult:
    generation: int
    tier: str
    chunks_written: int
    chunks_deduped: int
    chunks_sent: int
    durable: bool
    bytes_received: int
    window_kept: bool


@dataclass
class RestoredSession:
    layout: LayoutSpec
    generation: int
    token_ids: np.ndarray  # (num_tokens,) uint32
    chunk_keys: list[str]
    # Encoded blocks, verified by the server and again on decode: bytes when they came
    # inline; over shared memory a kvstore.format.chunk_run.PackedRun (views of one copy of
    # them, back to back, which the decode reads without joining).
    chunks: Sequence[bytes | memoryview]
    tail: bytes | memoryview
    window_blob: bytes | memoryview | None  # the window (codec chunk, ephemeral streams)
    # Decoded (empty / None with decode=False): (layers, entries, ...) over every token,
    # and the window's (layers, W, ...) or None when no window came back.
    persistent: dict[str, StreamData]
    window: dict[str, StreamData] | None
    window_start: int  # first token the window covers
    window_tier: str
    replay_needed: bool  # no window came back and the layout has window streams
    replayed: bool
    replay_tokens: int
    tier: str  # lowest tier any block came from
    restore_seconds: float
    replay_seconds: float
    # The server's write-back of this memory-acked generation failed: until it succeeds
    # (the server retries), the session does not survive a server restart.
    writeback_failed: bool = False
    # The session's model fingerprint as its spill stated it ("": none stated).
    model_fingerprint: str = ""
    # How the session's window (window_blob, or the held one a Restore without
    # want_window leaves out) was made: 0, the engine's own as spilled; else the tokens
    # of the replay that built it (this call's, or an earlier one's the server stored).
    window_replayed_tokens: int = 0

    @property
    def window_partial(self) -> bool:
        """The window came from this Resume's replay, shorter than the layout's window W:
        it holds only ``window_replayed_tokens`` of the ``min(W, num_tokens)`` tokens a
        full one does (the server does not keep it: the next call replays again)."""
        full = min(self.layout.window_tokens, len(self.token_ids))
        return self.window_blob is not None and 0 < self.window_replayed_tokens < full


@dataclass(frozen=True)
class WriteChunksResult:
    """A WriteChunks reply: prefix chunks stored as cache of the caller's domain."""

    chunks_written: int
    chunks_deduped: int  # held already with the same digest (sent or not)
    tier: str  # the highest tier the chunks landed in
    durable: bool
    chunk_keys: list[str]  # chain keys of the chunks from first_chunk on


@dataclass
class ReadChunksResult:
    """Chunks read by their position in a token sequence (ReadChunks)."""

    first_chunk: int
    keys: list[str]  # chain keys of the chunks asked for, from first_chunk on
    # chunk index -> its encoded bytes, verified here (digest, codec header against the
    # tokens); over shared memory a copy out of the segment, or with ``in_place`` a view
    # of it, valid until ``release``
    chunks: dict[int, bytes | memoryview]
    missing: dict[int, str]  # chunk index -> why not: not_held, corrupt, digest_mismatch,
    # tier_unavailable (the server's), or corrupt (failing the checks here)
    # gives a lent segment back to the client (from any thread, once; a no-op otherwise):
    # the chunks' views must not be read after it
    release: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)

    def __enter__(self) -> ReadChunksResult:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
