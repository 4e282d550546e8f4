"""Turning a request trace into the block reads and writes a tier simulation replays.

Conversations are recovered from the hash chain alone. Because a block id stands for its
whole prefix, request P's complete blocks are a prefix of request R exactly when R holds
P's last complete block id at the same position. R *resumes* the conversation of the
earlier request P with the longest such prefix (the latest one on a tie); otherwise R
starts a new conversation (it may still share blocks, e.g. a system prompt, with
others). A conversation is one kvtier session: each request spills its blocks and its
window blob, replacing the window of the conversation's previous request.

Only a request's complete blocks are chunks. Its last, partial block (input_length is
rarely a multiple of 512) is what kvtier keeps as the session's tail inside the manifest,
never in a tier, so it is not replayed as a block read; ``Workload.tail_blocks`` counts
them (the next turn's block over the same tokens has a new id anyway).

Window blobs get negative keys (request r's window is ``-(r + 1)``), chunk keys are the
trace's block ids (>= 0), so one integer space names every block a tier can hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.trace_reader import TraceRequest
from kvstore.pause_estimate import PauseEstimator
from kvstore.policy import ResumeHint

NEVER = 1 << 62  # "no further read" in next-use tables
# A conversation's last request in the trace: the oracle hint says it does not come back.
FINISHED_PAUSE_S = 1e9


@dataclass(frozen=True)
class Step:
    """One request, as the simulation replays it."""

    time_s: float
    blocks: tuple[int, ...]  # its complete blocks, in prompt order: what it spills
    reads: tuple[int, ...]  # the blocks it reads (see ``build_workload``), in order
    prev_blocks: tuple[int, ...]  # its conversation's stored blocks before it (or ())
    conversation: int
    window_prev: int | None  # the conversation's window to read, then replace (None: new)
    window_new: int | None  # this request's window key (None: no window layout or no block)
    next_gap_s: float | None  # true time to the conversation's next request (None: none)
    shared: frozenset[int]  # reads of blocks last used by another conversation


@dataclass(frozen=True)
class Workload:
    steps: list[Step]
    reads: np.ndarray  # (n,) int64: every read (chunks, then the window) in replay order
    next_read: np.ndarray  # (n,) int64: position of the next read of the same key, or NEVER
    unique_blocks: int  # distinct blocks spilled: the footprint
    block_reads: int
    tail_blocks: int  # partial last blocks left out (kept in the manifest, not in a tier)
    conversations: int
    resumes: int
    span_s: float

    def first_positions(self) -> dict[int, int]:
        """Key -> position of its first read (what a window is next used at when written)."""
        first: dict[int, int] = {}
        for position, key in enumerate(self.reads.tolist()):
            first.setdefault(key, position)
        return first


def build_workload(requests: Sequence[TraceRequest], *, windows: bool,
                   session_reads: bool = False) -> Workload:
    """Conversations, window keys and the read sequence of a trace (see module doc).

    A request reads all its complete blocks (a serving engine looking its prompt up by
    chunk key), or with ``session_reads`` only its conversation's stored blocks (what
    ``TierManager.restore`` of the session reads; other blocks are deduplicated on spill).
    """
    last_full: dict[int, int] = {}  # block id -> latest request whose complete prefix ends there
    conversation: list[int] = []
    stored: dict[int, tuple[int, ...]] = {}  # conversation -> blocks of its latest request
    current_window: dict[int, int] = {}  # conversation -> key of its latest window
    user: dict[int, int] = {}  # block -> conversation that used it last
    steps_raw = []
    for r, request in enumerate(requests):
        ids = request.hash_ids
        parent = next((last_full[ids[k]] for k in range(len(ids) - 1, -1, -1)
                       if ids[k] in last_full), None)
        conv = r if parent is None else conversation[parent]
        conversation.append(conv)
        blocks = ids[:request.full_blocks]
        prev = stored.get(conv, ())
        stored[conv] = blocks
        reads = prev if session_reads else blocks
        window_prev = current_window.pop(conv, None)
        window_new = -(r + 1) if windows and blocks else None
        if window_new is not None:
            current_window[conv] = window_new
        if blocks:
            last_full[blocks[-1]] = r
        shared = frozenset(b for b in reads if user.get(b, conv) != conv)
        user.update((b, conv) for b in blocks)
        steps_raw.append([request.timestamp_ms / 1000.0, blocks, reads, prev, conv, window_prev,
                          window_new, None, shared])

    next_time: dict[int, float] = {}
    for raw in reversed(steps_raw):
        time_s, conv = raw[0], raw[4]
        if conv in next_time:
            raw[7] = next_time[conv] - time_s
        next_time[conv] = time_s
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
        block_reads=sum(len(step.reads) for step in steps),
        tail_blocks=sum(len(r.hash_ids) - r.full_blocks for r in requests),
        conversations=len(set(conversation)),
        resumes=sum(1 for r, c in enumerate(conversation) if c != r),
        span_s=steps[-1].time_s - steps[0].time_s if steps else 0.0,
    )


def oracle_hints(workload: Workload, sigma: float, seed: int) -> list[ResumeHint]:
    """Hint of request r: the true gap to its conversation's next request x exp(sigma * z_r),
    z_r ~ N(0, 1) drawn once per request (seeded). It reads the trace's future: it stands for
    a framework that predicts its own pause with lognormal error. A conversation's last
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
        conv = step.conversation
        first.setdefault(conv, step.time_s)
        hints.append(estimator.on_spill(last.get(conv), first[conv], step.time_s))
        last[conv] = step.time_s
    return hints
