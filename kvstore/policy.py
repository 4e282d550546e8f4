"""Eviction policies: which block a full tier should give up first.

A policy knows nothing of tiers or bytes on media: it sees opaque block ids (chunk keys,
window keys, or a trace simulator's integers) through four calls, ``on_insert``,
``on_access``, ``on_remove`` and ``victim``. The tier manager keeps one policy instance
per tier; ``bench/trace.py`` can drive one directly with a virtual clock.

``LRUPolicy`` is the baseline. ``HintPolicy`` uses the resume hints an agent framework
can send (expected pause length, priority) to evict first the block that will be needed
latest, an online approximation of Belady's optimum; without hints it is exactly LRU.
"""

from __future__ import annotations

import abc
import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass

from kvstore.errors import InvalidRequest

BlockId = Hashable
Clock = Callable[[], float]


@dataclass(frozen=True)
class ResumeHint:
    """What an agent framework knows about a paused session.

    ``expected_pause_s``: seconds from the last access until the session is expected
    back (None: unknown). ``priority``: higher is more valuable; a lower-priority block
    is always evicted before a higher-priority one.
    """

    expected_pause_s: float | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        pause = self.expected_pause_s
        if pause is not None and (not math.isfinite(pause) or pause < 0):
            raise InvalidRequest(f"expected_pause_s must be finite and >= 0, got {pause}")
        if not isinstance(self.priority, int):
            raise InvalidRequest(f"priority must be an int, got {self.priority!r}")


class EvictionPolicy(abc.ABC):
    """Tracks the blocks of one tier and names the next victim.

    The caller owns membership: it reports every insert and removal, and ``victim`` only
    proposes; nothing leaves the policy until the caller reports ``on_remove``.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock

    @abc.abstractmethod
    def on_insert(self, block: BlockId, size: int = 0, hint: ResumeHint | None = None) -> None:
        """``block`` now lives in the tier (re-inserting counts as an access)."""

    @abc.abstractmethod
    def on_access(self, block: BlockId, hint: ResumeHint | None = None) -> None:
        """``block`` was read or rewritten; a given hint replaces the block's old one."""

    @abc.abstractmethod
    def on_remove(self, block: BlockId) -> None:
        """``block`` left the tier (unknown blocks are ignored)."""

    @abc.abstractmethod
    def victim(self, exclude: Collection[BlockId] = ()) -> BlockId | None:
        """The block to evict next, skipping ``exclude``; None when nothing is evictable."""

    @abc.abstractmethod
    def __contains__(self, block: BlockId) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        self._order: OrderedDict[BlockId, None] = OrderedDict()  # oldest first

    def on_insert(self, block: BlockId, size: int = 0, hint: ResumeHint | None = None) -> None:
        self.on_access(block, hint)

    def on_access(self, block: BlockId, hint: ResumeHint | None = None) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def on_remove(self, block: BlockId) -> None:
        self._order.pop(block, None)

    def victim(self, exclude: Collection[BlockId] = ()) -> BlockId | None:
        for block in self._order:
            if block not in exclude:
                return block
        return None

    def __contains__(self, block: BlockId) -> bool:
        return block in self._order

    def __len__(self) -> int:
        return len(self._order)


class _Level:
    """Blocks of one priority: hinted ones by predicted return, unhinted ones by recency."""

    def __init__(self) -> None:
        self.unhinted: OrderedDict[BlockId, float] = OrderedDict()  # block -> last access
        self.hinted: dict[BlockId, tuple[float, int]] = {}  # block -> (predicted next use, seq)
        self.heap: list[tuple[float, int, BlockId]] = []  # (-predicted next use, seq, block)

    def __len__(self) -> int:
        return len(self.unhinted) + len(self.hinted)

    def latest_return(self, exclude: Collection[BlockId]) -> tuple[float, BlockId] | None:
        """The live hinted block not in ``exclude`` with the latest predicted return.

        Stale entries (re-hinted or removed blocks) on the way are dropped for good;
        excluded ones are popped aside and pushed back: a few C-level heap operations,
        where the request being placed protects its own (recently hinted) blocks.
        """
        heap, hinted = self.heap, self.hinted
        aside = []
        found = None
        while heap:
            neg_next, seq, block = heap[0]
            if hinted.get(block) != (-neg_next, seq):
                heapq.heappop(heap)
            elif block in exclude:
                aside.append(heapq.heappop(heap))
            else:
                found = (-neg_next, block)
                break
        for item in aside:
            heapq.heappush(heap, item)
        return found


class HintPolicy(EvictionPolicy):
    """Evict the block predicted to be needed latest; lowest priority first.

    A hinted block is predicted back at ``last_access + expected_pause_s`` (an overdue
    one: now). An unhinted block is predicted back after as long again as it has been
    idle, ``now + (now - last_access)``, which orders unhinted blocks exactly as LRU does,
    so a policy that never receives a hint behaves as ``LRUPolicy``.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        self._levels: dict[int, _Level] = {}
        self._priority: dict[BlockId, int] = {}
        self._hints: dict[BlockId, ResumeHint] = {}  # the latest hint of each hinted block
        self._seq = itertools.count()

    def on_insert(self, block: BlockId, size: int = 0, hint: ResumeHint | None = None) -> None:
        self.on_access(block, hint)

    def on_access(self, block: BlockId, hint: ResumeHint | None = None) -> None:
        now = self.clock()
        if hint is None:  # a hinted block keeps its hint; its pause is measured from now
            hint = self._hints.get(block)
        self.on_remove(block)
        priority = 0 if hint is None else hint.priority
        level = self._levels.setdefault(priority, _Level())
        self._priority[block] = priority
        if hint is not None:
            self._hints[block] = hint
        if hint is None or hint.expected_pause_s is None:
            level.unhinted[block] = now
            return
        predicted = now + hint.expected_pause_s
        seq = next(self._seq)
        level.hinted[block] = (predicted, seq)
        heapq.heappush(level.heap, (-predicted, seq, block))
        if len(level.heap) > 2 * len(level.hinted) + 64:  # bound the stale entries
            level.heap = [(-p, q, b) for b, (p, q) in level.hinted.items()]
            heapq.heapify(level.heap)

    def on_remove(self, block: BlockId) -> None:
        priority = self._priority.pop(block, None)
        if priority is None:
            return
        self._hints.pop(block, None)
        level = self._levels[priority]
        level.unhinted.pop(block, None)
        if level.hinted.pop(block, None) is not None and not level.hinted:
            level.heap.clear()
        if not level:
            del self._levels[priority]

    def victim(self, exclude: Collection[BlockId] = ()) -> BlockId | None:
        now = self.clock()
        for priority in sorted(self._levels):
            level = self._levels[priority]
            best: BlockId | None = None
            best_next = -math.inf
            for block, last in level.unhinted.items():
                if block not in exclude:  # oldest first: the first one is the best unhinted
                    best, best_next = block, 2 * now - last
                    break
            latest = level.latest_return(exclude)
            if latest is not None and max(latest[0], now) > best_next:
                best = latest[1]
            if best is not None:
                return best
        return None

    def predicted_return(self, block: BlockId) -> float | None:
        """When ``block`` is expected back (clock units), or None if it has no pause hint."""
        priority = self._priority.get(block)
        if priority is None or block not in self._levels[priority].hinted:
            return None
        return self._levels[priority].hinted[block][0]

    def __contains__(self, block: BlockId) -> bool:
        return block in self._priority

    def __len__(self) -> int:
        return len(self._priority)
