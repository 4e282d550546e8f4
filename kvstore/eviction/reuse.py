"""ReusePolicy: evict the block expected to be read again latest, learned online.

One policy for every kind of block a tier holds: a session's chunks, a prefix shared by
many sessions, a retained chunk no session names, a window blob. It ranks them with no
future knowledge by *reuse density*, the expected reads per byte per second a block
gives from its current age on (the hit density of Beckmann et al., "LHD: Improving Cache
Hit Rate by Maximizing Hit Density", NSDI 2018), learned per *reuse class* from what
happened to earlier blocks of the class at each age (time since the block's last store
or read):

- reuse frequency: client reads of the block so far (0, 1, 2, 3 or more; ``NextUse.reads``).
  A block several sessions read (a shared document or system prompt) is read again more
  often than one only its own session stored.
- resume hint: the pause predicted by its last hinted store (``NextUse.pause``, sent by
  the framework or inferred by ``kvstore.eviction.pause_estimate``), in buckets: none, due,
  up to 30 s, 5 min, later. Whether a bucket predicts anything is learned, not assumed: a
  "not back soon" hint that proves wrong simply gets its class a higher density.
- size: density is per byte, so a window blob (several chunks' worth) must earn its room.

A block is worth what losing it costs (``cost``, in reads of a chunk from the tier below):
1 for a chunk, whose loss costs a read from a lower tier, and ``REPLAY_COST_READS`` for a
window blob, whose loss costs a bounded replay of W tokens through the model. ``victim``
ranks by density x cost per byte, and ``admits`` (asked before a retained chunk moves down)
compares a block's value with the lowest of a sample of the tier's.

The policies of one tier stack share one ``ReuseModel`` (``reuse_policies()`` makes the
factory): a block is read whichever tier holds it, so the model learns from every read
in the stack, not only from the reads a tier happened to serve, and a class evicted early
is not taken for one never read. Per class and age bin (log2 seconds) it counts reads
(an episode runs from a block's first store or a read to its next read), ends (the block
left every tier unread) and the episodes still open at each age; every ``REFRESH``
events it folds them into::

    density(c, a) = reads after age a / (time lived after age a), over the class's episodes

and ``victim`` takes, among ``SAMPLE`` blocks drawn at random (seeded) from the tier and
its ``OLDEST`` least recently used ones, the one of lowest priority, then lowest value
per byte: where the table says little (density falling with age, as at the start), the
oldest are the victims, as in LRU, which a random sample alone would often miss. Until a
class has its own events it leans on the pooled ones (``PRIOR``); before any, density
falls with age: LRU order. Blocks whose loss costs more than a read (window blobs, read
once by their session's resume and then replaced) are classed apart from chunks
(``KINDS``): their reuse is learned from windows alone, not from their session's chunks.
A block that arrives without a ``NextUse`` (never hinted) is in the no-hint class; the
model does not follow it, so it is ranked by the pooled table from its last access.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Container, Sequence
from typing import Any

import numpy as np

from kvstore.eviction.policies import BlockId, Clock, EvictionPolicy, NextUse

AGE_BINS = 24  # log2 seconds: bin 0 below 1 s, bin k in [2^(k-1), 2^k), the last open
READ_CLASSES = 4  # 0, 1, 2, 3+ reads
PAUSE_LIMITS_S = (1.0, 30.0, 300.0)  # due / short / medium / long; plus "no hint"
HINT_CLASSES = READ_CLASSES * (len(PAUSE_LIMITS_S) + 2)
KINDS = 2  # a chunk; a block whose loss costs more than a read (a window blob)
CLASSES = KINDS * HINT_CLASSES
SAMPLE = 64
OLDEST = 8  # least recently used blocks added to each sample
REFRESH = 512  # events between density recomputations
DECAY = 1.0  # weight kept by the older counts at each recomputation
PRIOR = 1.0  # pseudo-events per class, drawn from the pooled table, against noise
# an evicted episode's unread time, against a held one's (ReuseModel.left): 0 and 1 each
# lose to LRU somewhere (the mix shape at 2%; the synthetic trace at 2%), 0.3 on neither
CENSORED_WEIGHT = 0.3
# A bounded replay of W = 128 tokens against one chunk read from disk: bench.resume on the
# development machine restores 8 chunks from disk in 1.35 ms and replays in 28 ms.
REPLAY_COST_READS = 160.0
_WIDTHS = np.array([1.0] + [2.0 ** (k - 1) for k in range(1, AGE_BINS)])
# no data yet: density falling with age, so the policy starts as LRU
_START = 1.0 / np.cumsum(_WIDTHS)


def age_bin(age_s: float) -> int:
    if age_s < 1.0:
        return 0
    return min(AGE_BINS - 1, int(math.log2(age_s)) + 1)


def age_bins(ages: np.ndarray) -> np.ndarray:
    """``age_bin`` of each of ``ages``."""
    safe = np.maximum(ages, 1.0)
    return np.where(ages < 1.0, 0, np.minimum(np.floor(np.log2(safe)).astype(np.int64) + 1,
                                               AGE_BINS - 1))


def reuse_class(hint: NextUse | None, kind: int = 0) -> int:
    """The class of a block of ``kind`` from its ``NextUse`` (see the module doc)."""
    if hint is None:
        return kind * HINT_CLASSES  # never hinted: no reads known either
    pause = 0  # 0: no pause predicted; 1 due, 2 short, 3 medium, 4 long
    if hint.pause is not None:
        pause = 1 + sum(hint.pause > limit for limit in PAUSE_LIMITS_S)
    return (kind * HINT_CLASSES + min(hint.reads, READ_CLASSES - 1) * (len(PAUSE_LIMITS_S) + 2)
            + pause)


class ReuseModel:
    """Reads, ends and open episodes per class and age, for the policies of one stack."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._slot: dict[BlockId, int] = {}
        self._free: list[int] = []
        n = 1024  # episode arrays, grown by doubling
        self._cls = np.zeros(n, dtype=np.int64)
        self._since = np.zeros(n)
        self._open = np.zeros(n, dtype=bool)
        self._reads = np.zeros(n, dtype=np.int64)
        self._holders = np.zeros(n, dtype=np.int64)  # bit i: the tier of level i holds it
        self._hits = np.zeros((CLASSES, AGE_BINS))  # episodes ended by a read, by age
        self._lost = np.zeros((CLASSES, AGE_BINS))  # censored: left the stack unread
        self._events = 0
        self.density = np.tile(_START, (CLASSES, 1))

    def _new_slot(self, block: BlockId) -> int:
        if not self._free:
            n = len(self._cls)
            self._free.extend(range(2 * n - 1, n - 1, -1))
            for name in ("_cls", "_since", "_open", "_reads", "_holders"):
                old = getattr(self, name)
                grown = np.zeros(2 * n, dtype=old.dtype)
                grown[:n] = old
                setattr(self, name, grown)
        slot = self._slot[block] = self._free.pop()
        self._holders[slot] = 0
        return slot

    def seen(self, block: BlockId, hint: NextUse | None, level: int, kind: int = 0) -> None:
        """The policy of the tier at ``level``, which holds ``block`` (of ``kind``), was
        told of it."""
        if hint is None:
            return
        slot = self._slot.get(block)
        if slot is None:
            slot = self._new_slot(block)
            self._start(slot, hint, kind)
        elif hint.reads > self._reads[slot]:  # read since: the episode ends with a read
            if self._open[slot]:
                self._count(self._hits, slot)
            self._start(slot, hint, kind)
        else:  # stored again or moved: the episode goes on, in what it is known as now
            self._cls[slot] = reuse_class(hint, kind)
        self._holders[slot] |= 1 << level

    def left(self, block: BlockId, level: int) -> None:
        """The tier of ``level`` no longer holds ``block``. At its last the open episode is
        counted *censored*: its lived time, unread, weighed ``CENSORED_WEIGHT``. Not 1:
        a window blob evicted from the last tier that takes windows may have been read
        all the same (its resume replays), and counting it fully unread teaches the
        model that such blocks are read less, the more so the more it evicts them. Not
        0: a window its session never resumes must show as unread somehow (a chunk
        keeps a durable copy, so it shows by ageing unread while held)."""
        slot = self._slot.get(block)
        if slot is None:
            return
        self._holders[slot] &= ~(1 << level)
        if not self._holders[slot]:
            if self._open[slot]:
                self._count(self._lost, slot, CENSORED_WEIGHT)
            del self._slot[block]
            self._free.append(slot)

    def slot(self, block: BlockId) -> int:
        """The row the model keeps ``block`` in (-1: not followed, never hinted)."""
        return self._slot.get(block, -1)

    def holders(self, slots: np.ndarray) -> np.ndarray:
        """Per slot, the bit mask of tier levels holding its block (0 for -1)."""
        return np.where(slots >= 0, self._holders[np.maximum(slots, 0)], 0)

    def _start(self, slot: int, hint: NextUse, kind: int) -> None:
        self._cls[slot] = reuse_class(hint, kind)
        self._reads[slot] = hint.reads
        self._since[slot] = self.clock() if hint.since is None else hint.since
        self._open[slot] = True

    def _count(self, table: np.ndarray, slot: int, weight: float = 1.0) -> None:
        table[self._cls[slot], age_bin(self.clock() - self._since[slot])] += weight
        self._open[slot] = False
        self._events += 1
        if self._events >= REFRESH:
            self.refresh()

    def refresh(self) -> None:
        """Fold reads, ends and the open episodes' ages into the density table."""
        self._events = 0
        live = self._open
        bins = age_bins(self.clock() - self._since[live])
        open_now = np.zeros((CLASSES, AGE_BINS))
        np.add.at(open_now, (self._cls[live], bins), 1)
        reached = self._hits + self._lost + open_now  # episodes by the age they got to

        def density(reads: np.ndarray, reached: np.ndarray) -> np.ndarray:
            # (..., AGE_BINS): reads after each age over the time lived after it
            after = np.flip(np.cumsum(np.flip(reached, -1), -1), -1)
            reads_after = np.flip(np.cumsum(np.flip(reads, -1), -1), -1)
            life_after = np.flip(np.cumsum(np.flip(after * _WIDTHS, -1), -1), -1)
            return reads_after / np.maximum(life_after, 1e-12)

        pooled_reads, pooled = self._hits.sum(0), reached.sum(0)
        if pooled.sum() > 0:
            # PRIOR episodes shaped like the pooled ones, so a class with few episodes of
            # its own leans on the stack's overall pattern
            share = PRIOR / pooled.sum()
            self.density = density(self._hits + share * pooled_reads, reached + share * pooled)
        self._hits *= DECAY
        self._lost *= DECAY


class ReusePolicy(EvictionPolicy):
    """Lowest priority first, then lowest learned value per byte (module doc)."""

    ranks_retained = True  # a retained chunk's learned density says what it is worth

    def __init__(self, clock: Clock = time.monotonic, *, model: ReuseModel | None = None,
                 level: int = 0, seed: int = 0,
                 cost: Callable[[BlockId], float] | None = None) -> None:
        """``level``: the tier's place in its stack, highest 0 (``reuse_policies``);
        ``cost``: what losing a block costs, in chunk reads (None: 1 for every block)."""
        super().__init__(clock)
        self.model = ReuseModel(clock) if model is None else model
        self.level = level
        self.cost = cost
        self._index: dict[BlockId, int] = {}  # block -> its row in the arrays below
        self._order: list[BlockId] = []  # row -> block (rows stay dense: O(1) draws)
        n = 256
        self._cls = np.zeros(n, dtype=np.int64)
        self._since = np.zeros(n)
        self._size = np.ones(n)
        self._priority = np.zeros(n, dtype=np.int64)
        self._slot = np.full(n, -1, dtype=np.int64)  # the block's ReuseModel slot
        self._cost = np.ones(n)
        self._random = np.random.default_rng(seed)
        self._aged: list[tuple[float, int, BlockId]] = []  # lazy heap (since, seq, block)
        self._aged_of: dict[BlockId, int] = {}  # block -> the seq of its live heap entry
        self._aged_seq = itertools.count()
        self._sizes = 0  # sum of known sizes, for blocks listed without one
        self._sized = 0

    def on_insert(self, block: BlockId, size: int = 0, hint: NextUse | None = None) -> None:
        if block in self._index:
            self.on_access(block, hint)
            return
        if size <= 0:  # listed at open: the mean size known so far
            size = self._sizes // self._sized if self._sized else 1
        else:
            self._sizes += size
            self._sized += 1
        row = len(self._order)
        if row == len(self._cls):  # grow the rows by doubling
            for name, fill in (("_cls", 0), ("_since", 0), ("_size", 1), ("_priority", 0),
                               ("_slot", -1), ("_cost", 1)):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.full_like(old, fill)]))
        self._index[block] = row
        self._order.append(block)
        self._size[row] = size
        self._cost[row] = 1.0 if self.cost is None else self.cost(block)
        self._classify(block, row, hint)

    def on_access(self, block: BlockId, hint: NextUse | None = None) -> None:
        row = self._index.get(block)
        if row is None:
            self.on_insert(block, 0, hint)
            return
        self._classify(block, row, hint)

    def on_access_many(self, blocks: Sequence[BlockId], hints: Sequence[NextUse | None]
                       ) -> None:
        """``on_access`` of each block, the rows' arrays written once for the batch."""
        rows = [self._index.get(block) for block in blocks]
        if None in rows:  # new blocks grow the rows: one by one
            super().on_access_many(blocks, hints)
            return
        at = np.asarray(rows, dtype=np.int64)
        kinds = (self._cost[at] > 1.0).astype(np.int64).tolist()
        now = self.clock()
        for block, hint, kind in zip(blocks, hints, kinds, strict=True):
            self.model.seen(block, hint, self.level, kind)
        self._cls[at] = [reuse_class(hint, kind) for hint, kind in zip(hints, kinds, strict=True)]
        self._priority[at] = [0 if hint is None else hint.priority for hint in hints]
        since = [now if hint is None or hint.since is None else hint.since for hint in hints]
        self._since[at] = since
        self._slot[at] = [self.model.slot(block) for block in blocks]
        for block, when in zip(blocks, since, strict=True):
            seq = self._aged_of[block] = next(self._aged_seq)
            heapq.heappush(self._aged, (float(when), seq, block))
        self._bound_aged()

    def on_remove(self, block: BlockId) -> None:
        row = self._index.pop(block, None)
        if row is None:
            return
        self.model.left(block, self.level)
        del self._aged_of[block]
        last = self._order.pop()
        if last != block:  # move the last row into the freed one
            end = len(self._order)
            self._order[row] = last
            self._index[last] = row
            for array in (self._cls, self._since, self._size, self._priority, self._slot,
                          self._cost):
                array[row] = array[end]

    def _classify(self, block: BlockId, row: int, hint: NextUse | None) -> None:
        kind = int(self._cost[row] > 1.0)
        self.model.seen(block, hint, self.level, kind)
        self._cls[row] = reuse_class(hint, kind)
        self._priority[row] = 0 if hint is None else hint.priority
        since = None if hint is None else hint.since
        self._since[row] = self.clock() if since is None else since
        self._slot[row] = self.model.slot(block)
        seq = self._aged_of[block] = next(self._aged_seq)
        heapq.heappush(self._aged, (float(self._since[row]), seq, block))
        self._bound_aged()

    def _bound_aged(self) -> None:
        if len(self._aged) > 2 * len(self._order) + 64:  # bound the stale entries
            self._aged = [(float(self._since[self._index[b]]), q, b)
                          for b, q in self._aged_of.items()]
            heapq.heapify(self._aged)

    # -- choosing --

    def victim(self, exclude: Container[BlockId] = ()) -> BlockId | None:
        n = len(self._order)
        if n <= SAMPLE:
            return self._best(np.arange(n), exclude)
        rows = np.concatenate([self._random.integers(0, n, SAMPLE), self._oldest(exclude)])
        found = self._best(rows, exclude)
        return found if found is not None else self._best(np.arange(n), exclude)

    def _oldest(self, exclude: Container[BlockId]) -> np.ndarray:
        """The rows of the ``OLDEST`` least recently used blocks not in ``exclude``."""
        heap, live = self._aged, self._aged_of
        found: list[int] = []
        aside = []
        while heap and len(found) < OLDEST:
            entry = heapq.heappop(heap)
            if live.get(entry[2]) != entry[1]:
                continue  # re-keyed or removed: dropped for good
            aside.append(entry)
            if entry[2] not in exclude:
                found.append(self._index[entry[2]])
        for entry in aside:
            heapq.heappush(heap, entry)
        return np.array(found, dtype=np.int64)

    def _value(self, rows: np.ndarray) -> np.ndarray:
        """Expected reads per byte per second, times what losing the block costs."""
        density = self.model.density[self._cls[rows], age_bins(self.clock() - self._since[rows])]
        return density * self._cost[rows] / self._size[rows]

    def _best(self, rows: np.ndarray, exclude: Container[BlockId]) -> BlockId | None:
        """The block of ``rows`` to evict first, skipping ``exclude``: lowest priority;
        then a copy a higher tier also holds (it serves no read from here); then lowest
        value (density x cost per byte); equal values (ages past any read seen) oldest
        first."""
        if not len(rows):
            return None
        model, since = self.model, self._since[rows]
        slots = self._slot[rows]
        above = model.holders(slots) & ((1 << self.level) - 1)
        ranked = np.lexsort((since, self._value(rows), above == 0, self._priority[rows]))
        for k in ranked:
            block = self._order[rows[k]]
            if block not in exclude:
                return block
        return None

    def admits(self, block: BlockId, size: int, hint: NextUse | None = None) -> bool:
        """True when ``block`` is worth more (density x cost per byte, at the age its
        ``hint`` gives) than the lowest of ``SAMPLE`` blocks drawn from the tier, or the
        tier holds nothing; a higher priority than that block's also admits it."""
        n = len(self._order)
        if not n:
            return True
        rows = np.arange(n) if n <= SAMPLE else self._random.integers(0, n, SAMPLE)
        values = self._value(rows)
        low = int(np.lexsort((values, self._priority[rows]))[0])  # the sample's victim
        priority = 0 if hint is None else hint.priority
        if priority != self._priority[rows[low]]:
            return priority > self._priority[rows[low]]
        since = self.clock() if hint is None or hint.since is None else hint.since
        cost = 1.0 if self.cost is None else self.cost(block)
        density = self.model.density[reuse_class(hint, int(cost > 1.0)),
                                     age_bin(self.clock() - since)]
        return density * cost / max(size, 1) > values[low]

    def __contains__(self, block: BlockId) -> bool:
        return block in self._index

    def __len__(self) -> int:
        return len(self._index)


def reuse_policies(clock: Clock = time.monotonic, *,
                   cost: Callable[[BlockId], float] | None = None
                   ) -> Callable[[], ReusePolicy]:
    """A policy factory for one tier stack (``TierManager(policy=...)``): its policies
    share one ``ReuseModel``, so each learns from reads in every tier. ``cost``: what
    losing a block costs in chunk reads (``window_cost`` for a store's keys)."""
    model = ReuseModel(clock)
    levels = itertools.count()  # TierStack makes one policy per tier, highest first

    def make() -> ReusePolicy:
        level = next(levels)
        return ReusePolicy(clock, model=model, level=level, seed=level, cost=cost)
    return make


def window_cost(is_window: Callable[[Any], bool],  # of the stack's block ids (str keys)
                replay_cost: float = REPLAY_COST_READS) -> Callable[[BlockId], float]:
    """The ``cost`` of a stack whose window blobs ``is_window`` tells apart: a replay for
    a window, one chunk read for anything else."""
    return lambda block: replay_cost if is_window(block) else 1.0
