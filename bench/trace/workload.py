"""Turning a request trace into the kvtier calls an engine makes, for a tier simulation.

Sessions are recovered from the hash chain alone. A block id stands for its whole prefix,
so request P's complete blocks are a prefix of request R's exactly when R holds P's last
complete block id at the same position. R *continues* P's session only when P is that
session's latest request (its head) and the session is still alive: R restores it
(reading P's chunks and window) and spills its own complete blocks as the session's next
generation. Any other request starts a new session from whatever prefix kvtier holds:
``Lookup`` of its complete blocks gives the longest held run from the first, the engine
reads those chunks (a new session naming them by key, restored) and prefills the rest.
So a second branch from P, or a request sharing only a document or a system prompt with
others, never replaces anyone's session; it shares their chunks through dedupe.

Sessions end: each is deleted ``session_ttl_s`` after its last request (the framework's
TTL; ``None``: never). Its chunks that no other session names are then freed, or, with
``retain``, kept as evictable cache entries that a later lookup finds. ``held`` (the
lookup's answer) is computed here as the product would give it with nothing lost from
the tiers: a block is held while a live session names it, or, with ``retain``, once it
was ever stored. The simulation checks each of those reads against its tiers.

Only a request's complete blocks are chunks. Its last, partial block is what kvtier
keeps as the session's tail inside the manifest, never in a tier, so it is not replayed
as a block read; ``Workload.tail_blocks`` counts them.

Window blobs get negative keys (request r's window is ``-(r + 1)``), chunk keys are the
trace's block ids (>= 0), so one integer space names every block a tier can hold.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.trace.reader import TraceRequest
from kvstore.eviction.pause_estimate import PauseEstimator
from kvstore.format.hints import ResumeHint

NEVER = 1 << 62  # "no further read" in next-use tables
# A session's last request in the trace: the oracle hint says it does not come back.
FINISHED_PAUSE_S = 1e9
DEFAULT_SESSION_TTL_S = 300.0  # a prompt cache's usual 5 minutes


@dataclass(frozen=True)
class Ended:
    """A session deleted (its TTL passed) before a step: what it stored."""

    session: int
    blocks: tuple[int, ...]
    window: int | None


@dataclass(frozen=True)
class Step:
    """One request, as the simulation replays it."""

    time_s: float
    session: int  # the kvtier session it spills into (the request that started it)
    continues: bool  # it continues its session's head; else a new session from a lookup
    blocks: tuple[int, ...]  # its complete blocks, in prompt order: what it spills
    reads: tuple[int, ...]  # the blocks it reads: the lookup's held prefix, or its session's
    prev_blocks: tuple[int, ...]  # its session's stored blocks before it (or ())
    window_prev: int | None  # the session's window to read, then replace (None: new)
    window_new: int | None  # this request's window key (None: no window layout or no block)
    next_gap_s: float | None  # true time to the session's next request (None: none)
    shared: frozenset[int]  # reads of blocks last used by another session
    ended: tuple[Ended, ...]  # sessions whose TTL passed before this request


@dataclass(frozen=True)
class Workload:
    steps: list[Step]
    reads: np.ndarray  # (n,) int64: every read (chunks, then the window) in replay order
    next_read: np.ndarray  # (n,) int64: position of the next read of the same key, or NEVER
    unique_blocks: int  # distinct blocks spilled: the footprint
    block_reads: int  # complete blocks of every request: each a hit, a prefill or a re-prefill
    tail_blocks: int  # partial last blocks left out (kept in the manifest, not in a tier)
    sessions: int
    continuations: int  # requests that continued their session's head
    lookup_starts: int  # new sessions that found a held prefix by lookup
    span_s: float
    retain: bool
    session_ttl_s: float | None

    def first_positions(self) -> dict[int, int]:
        """Key -> position of its first read (what a window is next used at when written)."""
        first: dict[int, int] = {}
        for position, key in enumerate(self.reads.tolist()):
            first.setdefault(key, position)
        return first


class _Sessions:
    """Live sessions: head request, stored blocks, window, expiry (a lazy heap)."""

    def __init__(self, ttl_s: float | None) -> None:
        self.ttl_s = ttl_s
        self.head: dict[int, int] = {}  # session -> its latest request
        self.blocks: dict[int, tuple[int, ...]] = {}
        self.window: dict[int, int | None] = {}
        self.last: dict[int, float] = {}
        self._expiry: list[tuple[float, int]] = []

    def touch(self, session: int, request: int, now: float, blocks: tuple[int, ...],
              window: int | None) -> None:
        self.head[session], self.blocks[session], self.window[session] = request, blocks, window
        self.last[session] = now
        if self.ttl_s is not None:
            heapq.heappush(self._expiry, (now + self.ttl_s, session))

    def expire(self, now: float) -> list[Ended]:
        ended = []
        while self._expiry and self._expiry[0][0] < now:
            at, session = heapq.heappop(self._expiry)
            if session in self.last and self.last[session] + self.ttl_s == at:
                ended.append(Ended(session, self.blocks.pop(session),
                                   self.window.pop(session)))
                del self.head[session], self.last[session]
        return ended


def build_workload(requests: Sequence[TraceRequest], *, windows: bool, retain: bool = True,
                   session_ttl_s: float | None = DEFAULT_SESSION_TTL_S) -> Workload:
    """Sessions, lookups, window keys and the read sequence of a trace (see module doc)."""
    last_full: dict[int, int] = {}  # block id -> latest request whose complete blocks end there
    full: dict[int, tuple[int, ...]] = {}  # request -> its complete blocks
    session_of: dict[int, int] = {}  # request -> its session
    live = _Sessions(session_ttl_s)
    refs: dict[int, int] = {}  # block -> live sessions naming it
    stored: set[int] = set()  # every block ever spilled (retained ones stay held)
    user: dict[int, int] = {}  # block -> session that used it last
    steps_raw = []
    continuations = lookup_starts = 0
    for r, request in enumerate(requests):
        now = request.timestamp_ms / 1000.0
        ended = []
        for gone in live.expire(now):
            ended.append(gone)
            for b in gone.blocks:
                refs[b] -= 1
                if not refs[b]:
                    del refs[b]
        blocks = request.hash_ids[:request.full_blocks]
        # the id match is the whole test on a real trace (prefix hashes); comparing the
        # blocks keeps hand-written traces, whose ids need not be, honest too
        parent = next((last_full[blocks[k]] for k in range(len(blocks) - 1, -1, -1)
                       if blocks[k] in last_full
                       and full[last_full[blocks[k]]] == blocks[:k + 1]), None)
        session = None if parent is None else session_of[parent]
        continues = session is not None and live.head.get(session) == parent
        if continues:
            prev, window_prev = live.blocks[session], live.window[session]
            reads = prev
            continuations += 1
        else:
            session, prev, window_prev = r, (), None
            held = 0
            while held < len(blocks) and (blocks[held] in refs
                                          or (retain and blocks[held] in stored)):
                held += 1
            reads = blocks[:held]
            lookup_starts += held > 0
        window_new = -(r + 1) if windows and blocks else None
        if blocks:
            full[r] = blocks
            session_of[r] = session
            live.touch(session, r, now, blocks, window_new)
            last_full[blocks[-1]] = r
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
            for b in prev:
                refs[b] -= 1
                if not refs[b]:
                    del refs[b]
            stored.update(blocks)
        shared = frozenset(b for b in reads if user.get(b, session) != session)
        user.update((b, session) for b in blocks)
        steps_raw.append([now, session, continues, blocks, reads, prev, window_prev,
                          window_new, None, shared, tuple(ended)])

    next_time: dict[int, float] = {}
    for raw in reversed(steps_raw):
        time_s, session = raw[0], raw[1]
        if raw[3] and session in next_time:
            raw[8] = next_time[session] - time_s
        if raw[3]:
            next_time[session] = time_s
    steps = [Step(*raw) for raw in steps_raw]

    reads: list[int] = []
    for step in steps:
        reads.extend(step.reads)
        if step.window_prev is not None:
            reads.append(step.window_prev)
    next_read = np.full(len(reads), NEVER, dtype=np.int64)
    seen: dict[int, int] = {}
    for position in range(len(reads) - 1, -1, -1):
        key = reads[position]
        next_read[position] = seen.get(key, NEVER)
        seen[key] = position
    return Workload(
        steps=steps,
        reads=np.asarray(reads, dtype=np.int64),
        next_read=next_read,
        unique_blocks=len({b for step in steps for b in step.blocks}),
        block_reads=sum(len(step.blocks) for step in steps),
        tail_blocks=sum(len(r.hash_ids) - r.full_blocks for r in requests),
        sessions=len({step.session for step in steps if step.blocks}),
        continuations=continuations,
        lookup_starts=lookup_starts,
        span_s=steps[-1].time_s - steps[0].time_s if steps else 0.0,
        retain=retain,
        session_ttl_s=session_ttl_s,
    )


def oracle_hints(workload: Workload, sigma: float, seed: int) -> list[ResumeHint]:
    """Hint of request r: the true gap to its session's next request x exp(sigma * z_r),
    z_r ~ N(0, 1) drawn once per request (seeded). It reads the trace's future: it stands for
    a framework that predicts its own pause with lognormal error. A session's last
    request gets FINISHED_PAUSE_S (the framework knows the task ended)."""
    noise = np.exp(sigma * np.random.default_rng(seed).standard_normal(len(workload.steps)))
    return [ResumeHint(expected_pause_s=FINISHED_PAUSE_S if step.next_gap_s is None
                       else step.next_gap_s * float(factor))
            for step, factor in zip(workload.steps, noise, strict=True)]


def causal_hints(workload: Workload) -> list[ResumeHint | None]:
    """The hints kvtier infers itself when a framework sends none (``PauseEstimator``, as
    the TierManager runs it on every spill without a hint): from the past only."""
    estimator = PauseEstimator()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    hints: list[ResumeHint | None] = []
    for step in workload.steps:
        if not step.blocks:  # nothing to spill: the estimator sees no call
            hints.append(None)
            continue
        session = step.session
        first.setdefault(session, step.time_s)
        hints.append(estimator.on_spill(last.get(session), first[session], step.time_s))
        last[session] = step.time_s
    return hints
