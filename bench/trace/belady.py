"""Belady's offline reference as an ``EvictionPolicy``, weighted by what losing a block costs.

``NextUseTable`` holds, for the whole trace, the position of each read's next read of
the same key (computed backwards over the full read sequence before the replay starts).
The simulator moves its cursor with ``advance(position)`` at every read, so at any moment
``next_use(key)`` is the position of ``key``'s next read after now (``NEVER`` if none).
A block's next use only changes when it is read, and every read reaches the policy as an
``on_access`` or ``on_insert``, so ``BeladyPolicy`` can key a heap on it once per call.

Blocks differ in size and in what losing one costs (``cost``, in chunk reads: a window
blob's loss is a replay, ``REPLAY_COST_READS`` reads, though it is read once per resume
like a chunk). Plain Belady, blind to both, drops a window as readily as a chunk and is
beaten by online policies that weigh them. ``BeladyPolicy`` evicts the block of largest
*weighted distance* ``(next read - now) x size / cost``: the bytes x reads-until-use a
hit of it is worth (the classic extension of Belady to sizes and costs; with one size
and cost it is Belady itself). Blocks never read again go first, oldest first. It ranks
retained chunks among the rest (their next reads are in the table like any other's) and
admits a block moving down only if its weighted distance is below the tier's victim's:
bypass. Weighted caching has no simple exact optimum, so this is a reference, held to
being above every policy by ``bench.trace.compare.belady_bound`` on every run.
"""

from __future__ import annotations

import heapq
import itertools
import math
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
        self.position = 0  # the read the replay is at

    def advance(self, position: int) -> None:
        """The replay is at read ``position`` (each position once, in order)."""
        self.position = position
        self._current[self._reads[position]] = self._next_read[position]

    def next_use(self, key: Hashable) -> int:
        current = self._current.get(key)
        return self._first.get(key, NEVER) if current is None else current


class BeladyPolicy(EvictionPolicy):
    """Largest weighted distance first (module doc); never read again first, oldest first.

    A block's next read changes only when it is read, and every read reaches the policy
    as an ``on_access`` or ``on_insert``; its weight (size / cost) never changes. Blocks
    of one weight are thus ordered by next read alone: one lazy heap per weight, and the
    victim is the heap top of largest weighted distance now.
    """

    ranks_retained = True

    def __init__(self, table: NextUseTable,
                 cost: Callable[[BlockId], float] | None = None) -> None:
        """``cost``: what losing a block costs, in chunk reads (None: 1 for every block)."""
        super().__init__()
        self.table = table
        self.cost = cost
        self._entry: dict[BlockId, tuple[int, int]] = {}  # block -> (next use, seq)
        self._weight: dict[BlockId, float] = {}  # block -> size / cost
        self._sizes: dict[float, int] = {}  # weight -> blocks held of it
        # weight -> heap of (-next use, seq, block)
        self._heaps: dict[float, list[tuple[int, int, BlockId]]] = {}
        self._seq = itertools.count()

    def _weight_of(self, block: BlockId, size: int) -> float:
        cost = 1.0 if self.cost is None else self.cost(block)
        return max(size, 1) / max(cost, 1e-12)

    def on_insert(self, block: BlockId, size: int = 0, hint: NextUse | None = None) -> None:
        if block not in self._entry:
            weight = self._weight[block] = self._weight_of(block, size)
            self._sizes[weight] = self._sizes.get(weight, 0) + 1
        self.on_access(block, hint)

    def on_access(self, block: BlockId, hint: NextUse | None = None) -> None:
        weight = self._weight.get(block)
        if weight is None:  # never inserted: listed as held, size unknown
            self.on_insert(block, 0, hint)
            return
        entry = (self.table.next_use(block), next(self._seq))
        self._entry[block] = entry
        heap = self._heaps.setdefault(weight, [])
        heapq.heappush(heap, (-entry[0], entry[1], block))
        if len(heap) > 2 * self._sizes[weight] + 64:  # bound the stale entries
            heap[:] = [(-n, s, b) for b, (n, s) in self._entry.items()
                       if self._weight[b] == weight]
            heapq.heapify(heap)

    def on_remove(self, block: BlockId) -> None:
        if self._entry.pop(block, None) is None:
            return
        weight = self._weight.pop(block)
        self._sizes[weight] -= 1

    def _distance(self, next_use: int, weight: float) -> float:
        """Weighted distance of a block read next at ``next_use`` (inf: never)."""
        if next_use >= NEVER:
            return math.inf
        return (next_use - self.table.position) * weight

    def admits(self, block: BlockId, size: int, hint: NextUse | None = None) -> bool:
        farthest = self.victim()
        if farthest is None:
            return True
        mine = self._distance(self.table.next_use(block), self._weight_of(block, size))
        return mine < self._distance(self._entry[farthest][0], self._weight[farthest])

    def victim(self, exclude: Collection[BlockId] = ()) -> BlockId | None:
        best, best_key = None, None
        for weight, heap in self._heaps.items():
            found = self._top(heap, exclude)
            if found is None:
                continue
            next_use, seq = self._entry[found]
            # farthest weighted first; ties (never read again): oldest first
            key = (self._distance(next_use, weight), -seq)
            if best_key is None or key > best_key:
                best, best_key = found, key
        return best

    def _top(self, heap: list[tuple[int, int, BlockId]],
             exclude: Collection[BlockId]) -> BlockId | None:
        # Pop excluded entries aside (stale ones for good) and push them back: a handful of
        # C-level heap operations, where the request being placed protects its own blocks.
        entry = self._entry
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
