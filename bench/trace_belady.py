"""Belady's offline optimum as an ``EvictionPolicy``: evict the block read farthest ahead.

``NextUseTable`` holds, for the whole trace, the position of each read's next read of
the same key (computed backwards over the full read sequence before the replay starts).
The simulator moves its cursor with ``advance(position)`` at every read, so at any moment
``next_use(key)`` is the position of ``key``'s next read after now (``NEVER`` if none).
A block's next use only changes when it is read, and every read reaches the policy as an
``on_access`` or ``on_insert``, so ``BeladyPolicy`` can key a heap on it once per call.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterator

import numpy as np

from bench.trace_workload import NEVER
from kvstore.policy import BlockId, EvictionPolicy, ResumeHint


class NextUseTable:
    def __init__(self, reads: np.ndarray, next_read: np.ndarray, first: dict[int, int]) -> None:
        """``reads`` (n,) int64 keys in replay order; ``next_read`` (n,) int64 positions;
        ``first``: key -> position of its first read (shared, never modified here)."""
        if reads.shape != next_read.shape or reads.ndim != 1:
            raise ValueError(f"reads {reads.shape} and next_read {next_read.shape} must be "
                             "equal 1-D shapes")
        self._reads = reads.tolist()
        self._next_read = next_read.tolist()
        self._first = first
        self._current: dict[int, int] = {}  # keys read so far -> their next read

    def advance(self, position: int) -> None:
        """The replay is at read ``position`` (each position once, in order)."""
        self._current[self._reads[position]] = self._next_read[position]

    def next_use(self, key: int) -> int:
        current = self._current.get(key)
        return self._first.get(key, NEVER) if current is None else current


class BeladyPolicy(EvictionPolicy):
    """Farthest next read first; blocks never read again go first, oldest first."""

    def __init__(self, table: NextUseTable) -> None:
        super().__init__()
        self.table = table
        self._entry: dict[BlockId, tuple[int, int]] = {}  # block -> (next use, seq)
        self._heap: list[tuple[int, int, BlockId]] = []  # (-next use, seq, block)
        self._seq = itertools.count()

    def on_insert(self, block: BlockId, size: int = 0, hint: ResumeHint | None = None) -> None:
        self.on_access(block, hint)

    def on_access(self, block: BlockId, hint: ResumeHint | None = None) -> None:
        entry = (self.table.next_use(block), next(self._seq))
        self._entry[block] = entry
        heapq.heappush(self._heap, (-entry[0], entry[1], block))
        if len(self._heap) > 2 * len(self._entry) + 64:  # bound the stale entries
            self._heap = [(-n, s, b) for b, (n, s) in self._entry.items()]
            heapq.heapify(self._heap)

    def on_remove(self, block: BlockId) -> None:
        self._entry.pop(block, None)

    def _live(self, item: tuple[int, int, BlockId]) -> bool:
        return self._entry.get(item[2]) == (-item[0], item[1])

    def _farthest_first(self) -> Iterator[BlockId]:
        """Live blocks, farthest next use first, walking the heap's tree lazily."""
        heap = self._heap
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            item, i = heapq.heappop(frontier)
            if self._live(item):
                yield item[2]
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))

    def victim(self, exclude: Collection[BlockId] = ()) -> BlockId | None:
        for block in self._farthest_first():
            if block not in exclude:
                return block
        return None

    def __contains__(self, block: BlockId) -> bool:
        return block in self._entry

    def __len__(self) -> int:
        return len(self._entry)
