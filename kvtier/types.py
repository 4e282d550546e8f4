"""What the client returns, and how it retries: plain dataclasses, no gRPC."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from kvstore.format.chunk import StreamData
from kvstore.format.layout import LayoutSpec

if TYPE_CHECKING:
    import torch

# A session's tokens: a sequence, a numpy array or a 1-D tensor (kvtier.codec.as_tokens).
TokenIds: TypeAlias = "Sequence[int] | np.ndarray | torch.Tensor"


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
    # of it or (held by the server's host tier) a read-only view of the server's slab,
    # valid until ``release``
    chunks: dict[int, bytes | memoryview]
    missing: dict[int, str]  # chunk index -> why not: not_held, corrupt, digest_mismatch,
    # tier_unavailable (the server's), or corrupt (failing the checks here)
    # gives a lent segment back to the client and ends the read lease pinning the chunks
    # in the server's slabs (from any thread, once, never waiting on the server; a no-op
    # otherwise): the chunks' views must not be read after it
    release: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)

    def __enter__(self) -> ReadChunksResult:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


# -- control calls (Prefetch, Evict, Delete, Fork, Stat, List, Drain): the server's reply
# fields by the proto's names, as Python values; a submessage or optional field the reply
# left unset is None.


@dataclass(frozen=True)
class SessionRef:
    tenant: str
    session_id: str


@dataclass(frozen=True)
class SessionInfo:
    """A stored session (List, Stat with a session)."""

    session: SessionRef
    layout_id: str
    generation: int
    num_tokens: int
    chunks: int
    window_tier: str  # "": the window was dropped
    last_access_unix: float
    tiers: list[str]  # tiers holding at least one of its chunks
    writeback_failed: bool  # as in RestoredSession
    window_node_id: str  # fleet: the node whose memory holds the window ("": none)
    window_node_address: str  # where a router reaches that node
    model_fingerprint: str  # as its spill stated it; "": none stated


@dataclass(frozen=True)
class TierStat:
    name: str
    capacity_bytes: int
    used_bytes: int
    items: int
    available: bool
    lookups: int
    hits: int


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's use against its quotas; a limit of None is unlimited."""

    tenant: str
    sessions: int
    durable_bytes: int
    memory_bytes: int
    sessions_limit: int | None
    durable_bytes_limit: int | None
    memory_bytes_limit: int | None
    rejections: dict[str, int]  # quota -> spills refused
    retained_bytes: int  # unreferenced chunks of its dedupe domain kept as cache


@dataclass(frozen=True)
class NodeLiveness:
    """A fleet node's last heartbeat."""

    node_id: str
    address: str
    state: str  # serving, draining, drained or stopped
    heartbeat_age_s: float  # on the answering node's clock
    down: bool  # no heartbeat for the server's fleet_down_after_s, not stopped


@dataclass(frozen=True)
class FleetStat:
    """What a fleet node knows of its fleet."""

    sessions: int  # manifests in the shared bucket
    nodes_seen: list[str]
    gc_epoch: int
    gc_state: str  # marking, deleting or done
    gc_sweeper: str
    cas: dict[str, int]  # this node's manifest CAS writes: won, conflict, error
    nodes: list[NodeLiveness]


@dataclass(frozen=True)
class StatResult:
    """Tiers and counters (Stat); ``session``, ``tenant_usage`` and ``fleet`` when asked."""

    tiers: list[TierStat]
    sessions: int
    writeback_queue_depth: int
    replays: int
    session: SessionInfo | None
    tenant_usage: TenantUsage | None
    node_id: str
    retained_bytes: int  # unreferenced chunks kept as evictable cache (prefix reuse)
    retained_chunks: int
    fleet: FleetStat | None


@dataclass(frozen=True)
class PrefetchResult:
    tier: str
    complete: bool  # False: the timeout expired first
    seconds: float


@dataclass(frozen=True)
class EvictResult:
    tier: str  # the slowest tier holding one of the session's blocks after it
    window_dropped: bool


@dataclass(frozen=True)
class DeleteResult:
    chunks_released: int
    chunks_freed: int  # no other session referenced them


@dataclass(frozen=True)
class ForkResult:
    generation: int
    num_tokens: int
    chunks: int
    window_kept: bool


@dataclass(frozen=True)
class DrainProgress:
    """One step of a drain (``kvtier drain``)."""

    phase: str  # writes, writeback, windows, done
    writes_in_flight: int  # admitted before the drain began, not yet committed
    writeback_pending: int  # chunks queued for write-back to a durable tier
    writeback_failed: int  # sessions marked writeback_failed (retried until durable)
    windows_held: int  # sessions whose window this node still holds
    windows_released: int  # fleet: windows no peer took (those sessions replay elsewhere)
    done: bool  # nothing of a session depends on this node any more
    windows_moved: int  # fleet: windows a live peer adopted (those sessions resume there)
