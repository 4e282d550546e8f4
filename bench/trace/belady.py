"""Belady's offline optimum as an ``EvictionPolicy``: evict the block read farthest ahead.

``NextUseTable`` holds, for the whole trace, the position of each read's next read of
the same key (computed backwards over the full read sequence before the replay starts).
The simulator moves its cursor with ``advance(position)`` at every read, so at any moment
``next_use(key)`` is the position of ``key``'s next read after now (``NEVER`` if none).
A block's next use only changes when it is read, and every read reaches the policy as an
``on_access`` or ``on_insert``, so ``BeladyPolicy`` can key a heap on it once per call.
It ranks retained chunks among the rest (their next reads are in the table like any
other's) and admits a block moving down only if it is read sooner than the tier's
farthest: Belady's optimum with bypass, the offline reference every policy is held to.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Hashable

import numpy as np

from bench.trace.workload import NEVER
from kvstore.eviction.policies import BlockId, EvictionPolicy, NextUse


class NextUseTable:
    def __init__(self, reads: np.ndarray, next_read: np.ndarray, first: dict[int, int],
                 name: Callable[[int], Hashable] | None = None) -> None:
        """``reads`` (n,) int64 keys in replay order; ``next_read`` (n,) int64 positions;
        ``first``: key -> position of its first read. ``name`` maps a trace key to the key
        the policy is given (e.g. a tier key string); the default keeps the ints."""
        if reads.shape != next_read.shape or reads.ndim != 1:
            raise ValueError(f"reads {reads.shape} and next_read {next_read.shape} must be "
                             "equal 1-D shapes")
        self._reads = reads.tolist() if name is None else [name(k) for k in reads.tolist()]
        self._next_read = next_read.tolist()
        self._first = first if name is None else {name(k): p for k, p in first.items()}
        self._current: dict[Hashable, int] = {}  # keys read so far -> their next read

    def advance(self, position: int) -> None:
        """The replay is at read ``position`` (each position once, in order)."""
        self._current[self._reads[position]] = self._next_read[position]

    def next_use(self, key: Hashable) -> int:
        current = self._current.get(key)
        return self._first.get(key, NEVER) if current is None else current


class BeladyPolicy(EvictionPolicy):
    """Farthest next read first; blocks never read again go first, oldest first."""

    ranks_retained = True

    def __init__(self, table: NextUseTable) -> None:
        super().__init__()
        self.table = table
        self._entry: dict[BlockId, tuple[int, int]] = {}  # block -> (next use, seq)
        self._heap: list[tuple[int, int, BlockId]] = []  # (-next use, seq, block)
        self._seq = itertools.count()

    def on_insert(self, block: BlockId, size: int = 0, hint: NextUse | None = None) -> None:
        self.on_access(block, hint)

    def on_access(self, block: BlockId, hint: NextUse | None = None) -> None:
        entry = (self.table.next_use(block), next(self._seq))
        self._entry[block] = entry
        heapq.heappush(self._heap, (-entry[0], entry[1], block))
        if len(self._heap) > 2 * len(self._entry) + 64:  # bound the stale entries
            self._heap = [(-n, s, b) for b, (n, s) in self._entry.items()]
            heapq.heapify(self._heap)

    def on_remove(self, block: BlockId) -> None:
        self._entry.pop(block, None)

    def admits(self, block: BlockId, size: int, hint: NextUse | None = None) -> bool:
        farthest = self.victim()
        return farthest is None or self.table.next_use(block) < self._entry[farthest][0]

    def victim(self, exclude: Collection[BlockId] = ()) -> BlockId | None:
        # Pop excluded entries aside (stale ones for good) and push them back: a handful of
        # C-level heap operations, where the request being placed protects its own blocks.
        heap, entry = self._heap, self._entry
        aside = []
        found = None
        while heap:
            neg_next, seq, block = heap[0]
            if entry.get(block) != (-neg_next, seq):
                heapq.heappop(heap)
            elif block in exclude:
                aside.append(heapq.heappop(heap))
            else:
                found = block
                break
        for item in aside:
            heapq.heappush(heap, item)
        return found

    def __contains__(self, block: BlockId) -> bool:
        return block in self._entry

    def __len__(self) -> int:
        return len(self._entry)
