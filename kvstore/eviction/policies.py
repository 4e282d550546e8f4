"""Eviction policies: which block a full tier should give up first.

A policy knows nothing of tiers or bytes on media: it sees opaque block ids (chunk keys,
window keys, or a trace simulator's integers) through four calls, ``on_insert``,
``on_access``, ``on_remove`` and ``victim`` (and ``on_access_many``: a batch of reads as
one update). The tier manager keeps one policy instance
per tier; ``bench.trace`` can drive one directly with a virtual clock.

``LRUPolicy`` is the baseline. ``HintPolicy`` uses the resume hints an agent framework
can send (expected pause length, priority) to evict first the block that will be needed
latest, an online approximation of Belady's optimum; without hints it is exactly LRU.
``kvstore.eviction.reuse.ReusePolicy`` (the project's own, made by ``reuse_policies()``)
learns from the stack's reads which blocks come back, per reuse frequency, hint and size.

Policies never see a ``ResumeHint`` itself: a ``HintBook``, one per tier stack, turns the
hints of the sessions storing a block into the block's ``NextUse`` (a time on the
policies' clock), and every call about the block passes that on. A block moving between
tiers therefore keeps its predicted return: a move is not an access by its session.
"""

from __future__ import annotations

import abc
import bisect
import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Container, Hashable, Sequence
from dataclasses import dataclass

from kvstore.format.hints import ResumeHint

BlockId = Hashable
Clock = Callable[[], float]
SLACK_S = 1.0  # a predicted pause this close to the real one counts as right


@dataclass(frozen=True)
class NextUse:
    """When a block is predicted to be needed next, from resume hints (see ``HintBook``).

    ``at``: a time on the policies' clock (None: unknown); ``priority``: the hint's;
    ``reads``: client reads of the block since it was first hinted (a policy that sees
    the count grow knows an access was a read, not a spill's touch); ``since``: its last
    read, or its first store if never read (None: unknown), so its age survives moves
    between tiers and counts from its last use by a reader, not by a spill; ``pause``:
    the expected pause of the last hint stored with it (None: none said).
    """

    at: float | None = None
    priority: int = 0
    reads: int = 0
    since: float | None = None
    pause: float | None = None  # the pause predicted by the block's last hinted store


class _Returns:
    """The predicted returns of one block, one per hint of a session storing it."""

    __slots__ = ("at", "hinted", "last_used", "pause", "priority", "reads", "right", "since",
                 "wrong")

    def __init__(self, now: float) -> None:
        self.at: list[float] = []  # sorted
        self.last_used: float | None = None  # last store or read
        self.since = now  # last read, else first store
        self.priority = 0
        self.reads = 0
        self.pause: float | None = None
        self.hinted = False
        self.right = self.wrong = 0  # fulfilled returns within a factor of 2, or not

    def next_use(self, at: float | None) -> NextUse:
        return NextUse(at, self.priority, self.reads, self.since, self.pause)


class HintBook:
    """The predicted next use of every hinted block of one tier stack.

    ``stored``: a session stored the block now, with its resume hint: one predicted
    return more. ``read``: the block was read now: the predicted return nearest to now
    is the reader's own, fulfilled (early or late), and leaves. ``get``: the block's
    ``NextUse``: the earliest return still ahead, so a block shared by several sessions
    (a common prompt) stays as long as any of them is expected, and one session's "not
    coming back" does not make it a first victim; but a return missed long enough ago
    (the latest one that passed) predicts sooner, and then the block ages from it.
    ``forget``: the block left every tier.

    Hints can be wrong (a framework guessing its pause from past ones): a read also
    checks the fulfilled return against the pause predicted at the block's last store,
    and a block whose returns were more often wrong (off by more than a factor of 2)
    than right is given in LRU order, its hints ignored, until they prove right again.

    Sessions are not told apart (the stack sees chunk keys, not who stores them), so
    which return a read fulfils is a guess; at most ``MAX_RETURNS`` are kept per block.
    The book reads the same clock as the stack's policies.
    """

    MAX_RETURNS = 8

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._blocks: dict[BlockId, _Returns] = {}

    def stored(self, block: BlockId, hint: ResumeHint | None) -> None:
        entry = self._blocks.get(block)
        now = self.clock()
        if entry is None:  # kept even unhinted: its reads and age still tell something
            entry = self._blocks[block] = _Returns(now)
        entry.last_used = now
        if hint is None:
            return
        entry.hinted = True
        ahead = bool(entry.at) and entry.at[-1] > now
        entry.priority = max(entry.priority, hint.priority) if ahead else hint.priority
        if hint.expected_pause_s is not None:
            entry.pause = hint.expected_pause_s
            bisect.insort(entry.at, now + hint.expected_pause_s)
            if len(entry.at) > self.MAX_RETURNS:  # the oldest missed return, else the latest
                entry.at.pop(0 if entry.at[0] <= now else -1)

    def read(self, block: BlockId) -> None:
        entry = self._blocks.get(block)
        if entry is None:
            return
        now = self.clock()
        at, since = entry.at, entry.last_used
        entry.last_used = entry.since = now
        entry.reads += 1
        if at:
            i = bisect.bisect_left(at, now)
            if i == len(at) or (i > 0 and now - at[i - 1] <= at[i] - now):
                i -= 1
            if since is not None:  # the pause predicted at the last store vs the real one
                predicted, real = at[i] - since, now - since
                if max(predicted, real) > 2 * min(predicted, real) + SLACK_S:
                    entry.wrong += 1
                else:
                    entry.right += 1
            del at[i]

    def read_many(self, blocks: Collection[BlockId]) -> None:
        """``read`` of each block: a batch of reads from one restore."""
        known = self._blocks
        for block in blocks:
            if block in known:
                self.read(block)

    def get_many(self, blocks: Collection[BlockId]) -> list[NextUse | None]:
        """``get`` of each block."""
        known = self._blocks
        return [self.get(block) if block in known else None for block in blocks]

    def get(self, block: BlockId) -> NextUse | None:
        entry = self._blocks.get(block)
        if entry is None:
            return None
        if not entry.hinted:  # no predicted time: policies see it as used now (LRU)
            return entry.next_use(None)
        now, at = self.clock(), entry.at
        if entry.wrong > entry.right:  # its sessions' hints proved wrong: LRU order
            return entry.next_use(entry.last_used)
        i = bisect.bisect_right(at, now)
        ahead = at[i] if i < len(at) else None
        missed = at[i - 1] if i else None
        # a missed return predicts the block back after as long again as it is overdue
        # (see HintPolicy): the sooner of that and the next return ahead wins
        if ahead is not None and (missed is None or ahead - now <= now - missed):
            return entry.next_use(ahead)
        if missed is not None:
            return entry.next_use(max(missed, entry.last_used or missed))
        return entry.next_use(entry.last_used)

    def forget(self, block: BlockId) -> None:
        self._blocks.pop(block, None)

    def __len__(self) -> int:
        return len(self._blocks)


class EvictionPolicy(abc.ABC):
    """Tracks the blocks of one tier and names the next victim.

    The caller owns membership: it reports every insert and removal, and ``victim`` only
    proposes; nothing leaves the policy until the caller reports ``on_remove``.
    """

    # Whether the policy ranks unreferenced (retained) blocks among the rest itself; when
    # not, a tier stack evicts retained chunks before asking it (kvstore.prefix.chains).
    ranks_retained = False

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock

    @abc.abstractmethod
    def on_insert(self, block: BlockId, size: int = 0, hint: NextUse | None = None) -> None:
        """``block`` now lives in the tier (re-inserting counts as an access)."""

    @abc.abstractmethod
    def on_access(self, block: BlockId, hint: NextUse | None = None) -> None:
        """``block`` was read, rewritten or re-hinted; ``hint``: its predicted next use
        (None: nothing known, the block was just used)."""

    def on_access_many(self, blocks: Sequence[BlockId], hints: Sequence[NextUse | None]
                       ) -> None:
        """``on_access`` of each block, ``hints[i]`` its predicted next use: the reads of
        one batch, as one update."""
        for block, hint in zip(blocks, hints, strict=True):
            self.on_access(block, hint)

    @abc.abstractmethod
    def on_remove(self, block: BlockId) -> None:
        """``block`` left the tier (unknown blocks are ignored)."""

    @abc.abstractmethod
    def victim(self, exclude: Container[BlockId] = ()) -> BlockId | None:
        """The block to evict next, skipping ``exclude``; None when nothing is evictable."""

    def admits(self, block: BlockId, size: int, hint: NextUse | None = None) -> bool:
        """Whether the tier, full, would rather hold ``block`` (not held here, ``size``
        bytes, predicted ``hint``) than its next victim. A tier stack asks before moving
        down a block it need not keep (a retained chunk): False means the policy ranks
        it below everything it holds. A policy with no such ranking (LRU: a block placed
        is the most recently used) admits every block."""
        return True

    @abc.abstractmethod
    def __contains__(self, block: BlockId) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        self._order: OrderedDict[BlockId, None] = OrderedDict()  # oldest first

    def on_insert(self, block: BlockId, size: int = 0, hint: NextUse | None = None) -> None:
        self.on_access(block, hint)

    def on_access(self, block: BlockId, hint: NextUse | None = None) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def on_access_many(self, blocks: Sequence[BlockId], hints: Sequence[NextUse | None]
                       ) -> None:
        order = self._order
        order.update(dict.fromkeys(blocks))
        for block in blocks:
            order.move_to_end(block)

    def on_remove(self, block: BlockId) -> None:
        self._order.pop(block, None)

    def victim(self, exclude: Container[BlockId] = ()) -> BlockId | None:
        for block in self._order:
            if block not in exclude:
                return block
        return None

    def __contains__(self, block: BlockId) -> bool:
        return block in self._order

    def __len__(self) -> int:
        return len(self._order)


class _Level:
    """The blocks of one priority, each keyed by a reference time ``r`` (see HintPolicy).

    Two lazy heaps over the same entries: the stalest block (smallest ``r``) and the one
    due latest (largest ``r``); one of the two is the level's victim.
    """

    def __init__(self) -> None:
        self.entries: dict[BlockId, tuple[float, int]] = {}  # block -> (r, seq)
        self.stalest: list[tuple[float, int, BlockId]] = []  # (r, seq, block)
        self.latest: list[tuple[float, int, BlockId]] = []  # (-r, seq, block)

    def add(self, block: BlockId, r: float, seq: int) -> None:
        self.entries[block] = (r, seq)
        heapq.heappush(self.stalest, (r, seq, block))
        heapq.heappush(self.latest, (-r, seq, block))
        if len(self.stalest) > 2 * len(self.entries) + 64:  # bound the stale entries
            self.stalest = [(r, q, b) for b, (r, q) in self.entries.items()]
            self.latest = [(-r, q, b) for b, (r, q) in self.entries.items()]
            heapq.heapify(self.stalest)
            heapq.heapify(self.latest)

    def first(self, heap: list[tuple[float, int, BlockId]], sign: int,
              exclude: Container[BlockId], stop: float = math.inf
              ) -> tuple[float, BlockId] | None:
        """(r, block) of the first live block of ``heap`` not in ``exclude`` whose heap key
        (``sign * r``) is below ``stop``, or None.

        Stale entries (re-keyed or removed blocks) on the way are dropped for good;
        excluded ones are popped aside and pushed back: a few C-level heap operations,
        where the request being placed protects its own blocks.
        """
        entries = self.entries
        aside = []
        found = None
        while heap and heap[0][0] < stop:
            key, seq, block = heap[0]
            if entries.get(block) != (sign * key, seq):
                heapq.heappop(heap)
            elif block in exclude:
                aside.append(heapq.heappop(heap))
            else:
                found = (sign * key, block)
                break
        for item in aside:
            heapq.heappush(heap, item)
        return found


class HintPolicy(EvictionPolicy):
    """Evict the block predicted to be needed latest; lowest priority first.

    Each block has a reference time ``r``: a hinted block's predicted return
    (``NextUse.at``); an unhinted block's last access. Its predicted next use is
    ``now + |now - r|``: the predicted return while that is ahead; once ``r`` has
    passed, as long again as the block has been idle (since its last access, or since
    the return it missed), so a block whose session never comes back grows stale like
    an unused one instead of pinning the tier. Unhinted blocks are thus ordered exactly
    as LRU orders them: a policy that never receives a hint is ``LRUPolicy``.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        self._levels: dict[int, _Level] = {}
        self._priority: dict[BlockId, int] = {}
        self._seq = itertools.count()

    def on_insert(self, block: BlockId, size: int = 0, hint: NextUse | None = None) -> None:
        self.on_access(block, hint)

    def on_access(self, block: BlockId, hint: NextUse | None = None) -> None:
        self.on_remove(block)
        priority = 0 if hint is None else hint.priority
        self._priority[block] = priority
        r = self.clock() if hint is None or hint.at is None else hint.at
        self._levels.setdefault(priority, _Level()).add(block, r, next(self._seq))

    def on_remove(self, block: BlockId) -> None:
        priority = self._priority.pop(block, None)
        if priority is None:
            return
        level = self._levels[priority]
        del level.entries[block]
        if not level.entries:
            del self._levels[priority]

    def victim(self, exclude: Container[BlockId] = ()) -> BlockId | None:
        now = self.clock()
        for priority in sorted(self._levels):
            level = self._levels[priority]
            stalest = level.first(level.stalest, 1, exclude)
            if stalest is None:
                continue  # all of this level excluded
            # the block due latest wins only if it is due further ahead than the stalest
            # one has been idle: stop the search at r <= now + |now - r_stalest|
            bound = now + abs(now - stalest[0])
            latest = level.first(level.latest, -1, exclude, stop=-bound)
            return stalest[1] if latest is None else latest[1]
        return None

    def reference_time(self, block: BlockId) -> float | None:
        """``block``'s ``r`` (predicted return or last access), None if not held."""
        priority = self._priority.get(block)
        return None if priority is None else self._levels[priority].entries[block][0]

    def __contains__(self, block: BlockId) -> bool:
        return block in self._priority

    def __len__(self) -> int:
        return len(self._priority)
