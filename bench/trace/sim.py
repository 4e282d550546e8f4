"""A byte-accurate simulation of the tier stack, replaying a ``Workload``.

It mirrors ``kvstore.placement.stack.TierStack`` and the manager's spill and restore:

- A block goes to the highest tier with room; making room asks the tier's policy for
  victims. A victim moves to the next tier down that holds it already or takes it (which
  may evict there in turn); a window blob that no window tier takes is dropped.
- A read is served by the highest tier holding the block, and the policy of that tier
  sees an access; a block read below the top tier is then promoted: placed again from
  the top (the lower copy stays, as in ``TierStack.promote``).
- A spill touches every block of the request with the request's hint (all tiers holding
  it), places the ones no tier holds, places the new window blob, drops the session's
  previous generation (chunks no session names any more are freed from every tier, as
  the manager's reference counts do, or with ``retain`` kept as cache), deletes the old
  window, then writes back to the durable tier every block without a durable copy
  (``ack="memory"``; the write-back's read is not an access).
- A session whose TTL passed is deleted the same way (``end``).
- Retained chunks (``retain``: unreferenced, kept) are what eviction takes first, oldest
  retained first, before the tier's policy is asked, unless the policy ranks them itself
  (``ranks_retained``: kvtier's and Belady's do); an evicted one moves down like any
  other block, except past a full tier whose policy does not ``admits`` it, and is
  dropped where no tier below takes it (``kvstore.prefix.chains.Retention``,
  ``TierStack.evict_first`` and ``_evict_retained``). A spill naming one revives it.
- A new session from a lookup first names the held prefix by key (a spill of those
  chunks, no hint, which revives retained ones), then reads them as its restore does.
- Making room for a request's promotion or spill never evicts that request's own blocks
  (the manager's ``protect``); the demotions this sets off lower down protect nothing.
- The last copy of a referenced chunk is never dropped, except from a bounded bottom
  tier: there nothing lies below, and the simulation drops it as if its session had
  expired (the manager would refuse the spill with ``TierFull`` instead).

Keys are ints: chunks >= 0, windows < 0 (see ``bench.trace.workload``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from bench.trace.workload import Ended, Workload
from kvstore.eviction.policies import EvictionPolicy, HintBook
from kvstore.format.hints import ResumeHint
from kvstore.session.restore import READ_BATCH

CAUSES = ("spill", "promotion", "demotion", "writeback")


@dataclass(frozen=True)
class SimTier:
    name: str
    capacity_bytes: float  # math.inf: unbounded
    holds_window: bool
    durable: bool


@dataclass
class SimCounters:
    tiers: tuple[str, ...]
    block_reads: int = 0
    block_hits: list[int] = field(default_factory=list)  # per tier
    shared_reads: int = 0  # reads of a block last used by another conversation
    shared_hits: list[int] = field(default_factory=list)  # per tier, of those reads
    new_blocks: int = 0  # never read before: prefill of new tokens, unavoidable
    reprefill_blocks: int = 0  # read before, now in no tier: re-prefill
    reprefill_requests: int = 0
    read_misses: int = 0  # reads (restore or lookup) no tier served
    resumes: int = 0  # requests continuing a conversation that has a window blob
    window_hits: list[int] = field(default_factory=list)  # per tier
    replays: int = 0  # resumes whose window was in no window tier
    bytes_written: dict[str, list[int]] = field(default_factory=dict)  # cause -> per tier
    evictions: list[int] = field(default_factory=list)
    windows_dropped: int = 0
    chunks_dropped: int = 0  # last copies dropped from a bounded bottom tier
    freed_chunks: int = 0  # no session names them any more (and not retained)
    retained_chunks: int = 0  # kept past their last reference
    retained_hits: int = 0  # reads of a chunk that was retained when looked up
    lookup_starts: int = 0  # new sessions that read a looked-up prefix
    lookup_blocks: int = 0  # blocks those read
    sessions_ended: int = 0

    def __post_init__(self) -> None:
        n = len(self.tiers)
        self.block_hits = [0] * n
        self.shared_hits = [0] * n
        self.window_hits = [0] * n
        self.evictions = [0] * n
        self.bytes_written = {cause: [0] * n for cause in CAUSES}

    def comparable(self) -> dict:
        """The counts a real tier stack or manager also keeps, for the validation checks."""
        return {
            "block_hits": self.block_hits,
            "misses": self.read_misses,
            "window_hits": self.window_hits,
            "replays": self.replays,
            "evictions": self.evictions,
            "bytes_written": [sum(per_tier[j] for per_tier in self.bytes_written.values())
                              for j in range(len(self.tiers))],
            "windows_dropped": self.windows_dropped,
            "freed_chunks": self.freed_chunks,
            "retained_chunks": self.retained_chunks,
        }


class _Skip:
    """Victims to pass over: already tried, protected, and busy keys (the manager holds
    the lock of a key being promoted or evicted, and eviction skips locked keys)."""

    def __init__(self, protect: Collection[int], busy: set[int]) -> None:
        self.tried: set[int] = set()
        self.protect, self.busy = protect, busy

    def __contains__(self, key: object) -> bool:
        return key in self.tried or key in self.protect or key in self.busy


class _Retained:
    """Retained chunks, oldest retained first, per tier holding them: one sequence over
    the stack, as ``Retention`` keeps one order for every tier (lazy heaps)."""

    def __init__(self, tiers: int) -> None:
        self.seq: dict[int, int] = {}  # retained key -> when it was retained
        self._heaps: list[list[tuple[int, int]]] = [[] for _ in range(tiers)]
        self._count = itertools.count()

    def keep(self, key: int, tiers: Iterable[int]) -> None:
        seq = self.seq[key] = next(self._count)
        for j in tiers:
            heapq.heappush(self._heaps[j], (seq, key))

    def held(self, j: int, key: int) -> None:
        """Tier ``j`` took ``key`` (retained or not)."""
        seq = self.seq.get(key)
        if seq is not None:
            heapq.heappush(self._heaps[j], (seq, key))

    def drop(self, key: int) -> None:
        self.seq.pop(key, None)

    def first(self, j: int, skip: Collection[int], held: Callable[[int], bool]) -> int | None:
        """The oldest retained key tier ``j`` holds (``held``) not in ``skip``."""
        heap, aside, found = self._heaps[j], [], None
        while heap:
            seq, key = heap[0]
            if self.seq.get(key) != seq or not held(key):
                heapq.heappop(heap)
            elif key in skip:
                aside.append(heapq.heappop(heap))
            else:
                found = key
                break
        for item in aside:
            heapq.heappush(heap, item)
        return found


class TierSim:
    def __init__(self, tiers: Sequence[SimTier], policy: Callable[[], EvictionPolicy],
                 block_bytes: int, window_bytes: int, *, retain: bool = True,
                 retained_first: bool = True) -> None:
        self.tiers = tuple(tiers)
        # every tier gets the factory's policy, as in TierStack: an unbounded tier never
        # asks its own for a victim, but a policy may learn from what reaches it
        self.policies = [policy() for _ in self.tiers]
        self.used = [0] * len(self.tiers)
        self.block_bytes, self.window_bytes = block_bytes, window_bytes
        bounded = [p for p, t in zip(self.policies, self.tiers, strict=True)
                   if not math.isinf(t.capacity_bytes)]
        self.hints = HintBook((bounded or self.policies)[0].clock)  # as TierStack.hints
        self.counters = SimCounters(tuple(t.name for t in self.tiers))
        self.where: dict[int, int] = {}  # key -> bit i set when tier i holds it
        self._busy: set[int] = set()  # keys whose lock the manager would hold now
        self.refs: dict[int, int] = {}  # chunk -> sessions whose stored blocks name it
        self.retain = retain
        # as the manager: retained chunks go before the policy is asked (False: a what-if
        # where the tier's policy ranks them with the rest)
        self.retained_first = retained_first
        self.retained = _Retained(len(self.tiers))
        self._durable = [i for i, t in enumerate(self.tiers) if t.durable]
        self._durable_mask = sum(1 << i for i in self._durable)
        self._window_tiers = [t.holds_window for t in self.tiers]
        self._last = len(self.tiers) - 1

    def size(self, key: int) -> int:
        return self.window_bytes if key < 0 else self.block_bytes

    def holders(self, key: int) -> list[int]:
        mask = self.where.get(key, 0)
        return [i for i in range(len(self.tiers)) if mask >> i & 1]

    # -- placement (TierStack.place / _put / _make_room / _evict / delete) --

    def place(self, key: int, cause: str, start: int = 0, stop: int | None = None,
              protect: Collection[int] = (), admit: bool = False) -> int | None:
        mask = self.where.get(key, 0)
        for j in range(start, len(self.tiers) if stop is None else stop):
            if key < 0 and not self._window_tiers[j]:
                continue
            if mask >> j & 1:
                self.policies[j].on_access(key, self.hints.get(key))
                return j
            size = self.size(key)
            if admit and self.tiers[j].capacity_bytes - self.used[j] < size \
                    and not self.policies[j].admits(key, size, self.hints.get(key)):
                continue
            if self._put(j, key, cause, protect):
                return j
        return None

    def _put(self, j: int, key: int, cause: str, protect: Collection[int]) -> bool:
        size = self.window_bytes if key < 0 else self.block_bytes
        capacity = self.tiers[j].capacity_bytes
        if size > capacity:
            return False
        policy = self.policies[j]
        if capacity - self.used[j] < size:
            skip = _Skip(protect, self._busy)
            while capacity - self.used[j] < size:
                # as TierStack: retained first, unless the policy ranks them itself
                first = self.retained_first and not policy.ranks_retained
                victim = self.retained.first(j, skip, lambda k: self.where.get(k, 0) >> j & 1
                                             ) if first else None
                if victim is None:
                    victim = policy.victim(skip)
                if victim is None:
                    return False
                skip.tried.add(victim)
                self._busy.add(victim)
                self._evict(j, victim)
                self._busy.discard(victim)
        self.used[j] += size
        self.where[key] = self.where.get(key, 0) | 1 << j
        self.retained.held(j, key)
        policy.on_insert(key, size, self.hints.get(key))
        self.counters.bytes_written[cause][j] += size
        return True

    def _evict(self, j: int, key: int) -> bool:
        if key >= 0 and key not in self.refs:  # retained: down if admitted, else dropped
            self.place(key, "demotion", start=j + 1, admit=True)
            self.delete(j, key, evicted=True)
            return True
        target = self.place(key, "demotion", start=j + 1)
        if target is None:
            elsewhere = self.where.get(key, 0) & ~(1 << j)
            if key >= 0 and not elsewhere and j != self._last:
                return False  # the last copy of a referenced chunk stays
            if key < 0:
                self.counters.windows_dropped += 1
            elif not elsewhere:
                self.counters.chunks_dropped += 1
        self.delete(j, key, evicted=True)
        return True

    def delete(self, j: int, key: int, evicted: bool = False) -> None:
        mask = self.where.get(key, 0)
        if mask >> j & 1:
            self.used[j] -= self.size(key)
            self.policies[j].on_remove(key)
            mask &= ~(1 << j)
            if mask:
                self.where[key] = mask
            else:
                del self.where[key]
                self.retained.drop(key)  # Retention.forget: it left its last tier
                self.hints.forget(key)  # as TierStack.delete
            if evicted:
                self.counters.evictions[j] += 1

    def delete_everywhere(self, key: int) -> None:
        for j in range(len(self.tiers)):
            self.delete(j, key)
        self.hints.forget(key)

    # -- reads (TierStack.read, then the restore's promotion) --

    def top(self, key: int) -> int | None:
        """The highest tier holding ``key`` (None: none)."""
        mask = self.where.get(key, 0)
        return (mask & -mask).bit_length() - 1 if mask else None

    def read(self, key: int, protect: Collection[int], promote: bool = True) -> int | None:
        """The tier that served ``key`` (promoting it when below the top, unless
        ``promote`` is False: the caller calls ``promote`` later), or None."""
        j = self.top(key)
        if j is None:
            return None
        self.hints.read(key)
        self.policies[j].on_access(key, self.hints.get(key))
        if j > 0 and promote:
            self.promote(key, j, protect)
        return j

    def promote(self, key: int, source: int, protect: Collection[int]) -> None:
        self._busy.add(key)
        self.place(key, "promotion", start=0, stop=source, protect=protect)
        self._busy.discard(key)

    # -- spill (the manager's _store_chunk / _store_window / _write_back) --

    def touch(self, key: int, hint: ResumeHint | None) -> int:
        """Re-hint ``key`` where it is held; returns its tier mask."""
        self.hints.stored(key, hint)
        expected = self.hints.get(key)
        mask = self.where.get(key, 0)
        for i in range(len(self.tiers)):
            if mask >> i & 1:
                self.policies[i].on_access(key, expected)
        return mask

    def reference(self, keys: Iterable[int]) -> None:
        """Sessions name ``keys`` (once each); a retained one is revived."""
        for key in keys:
            count = self.refs.get(key, 0)
            self.refs[key] = count + 1
            if not count:
                self.retained.drop(key)

    def release(self, keys: Iterable[int]) -> None:
        """A reference each to ``keys`` went away: the unreferenced are kept or freed."""
        refs = self.refs
        for key in keys:
            refs[key] -= 1
            if refs[key]:
                continue
            del refs[key]
            mask = self.where.get(key, 0)
            if self.retain and mask:
                self.counters.retained_chunks += 1
                self.retained.keep(key, (j for j in range(len(self.tiers)) if mask >> j & 1))
            else:
                self.delete_everywhere(key)
                self.counters.freed_chunks += 1

    def end(self, ended: Ended) -> None:
        """A session deleted: its chunks lose a reference, its window goes."""
        self.counters.sessions_ended += 1
        self.release(ended.blocks)
        if ended.window is not None:
            self.delete_everywhere(ended.window)

    def spill(self, blocks: Sequence[int], prev_blocks: Sequence[int], window_new: int | None,
              window_old: int | None, hint: ResumeHint | None) -> None:
        """One session's new generation ``blocks`` replacing ``prev_blocks``."""
        self.reference(blocks)  # pinned first, as the manager does: placing never frees them
        queued = []
        protect = frozenset(blocks)
        for key in blocks:
            mask = self.touch(key, hint)
            if not mask:
                placed = self.place(key, "spill", protect=protect)
                mask = 0 if placed is None else 1 << placed
            if self._durable and not mask & self._durable_mask:
                queued.append(key)
        if window_new is not None:
            self.touch(window_new, hint)
            self.place(window_new, "spill")
        self.release(prev_blocks)
        if window_old is not None:
            self.delete_everywhere(window_old)
        for key in queued:
            mask = self.where.get(key, 0)
            if not mask or mask & self._durable_mask:
                continue
            for j in self._durable:
                if self.place(key, "writeback", start=j, stop=j + 1) is not None:
                    break

    def name_held(self, keys: Sequence[int]) -> list[int]:
        """A new session's first spill naming looked-up chunks by key, no hint (no
        bytes): the run of ``keys`` some tier still holds, now referenced."""
        held = []
        for key in keys:
            if not self.where.get(key, 0):
                break
            self.touch(key, None)
            held.append(key)
        self.reference(held)
        return held


def replay(workload: Workload, sim: TierSim, hints: Sequence[ResumeHint | None],
           set_time: Callable[[float], None], advance: Callable[[int], None] | None = None
           ) -> SimCounters:
    """Run every step through ``sim``; ``set_time`` moves the policies' virtual clock and
    ``advance`` (Belady's table) is told each read position."""
    counters = sim.counters
    seen: set[int] = set()  # blocks spilled before
    position = 0
    for step, hint in zip(workload.steps, hints, strict=True):
        set_time(step.time_s)
        for ended in step.ended:
            sim.end(ended)
        session = set(step.reads)  # the blocks being read: never their own victims
        if step.window_prev is not None:
            session.add(step.window_prev)
        named: list[int] = []
        retained: set[int] = set()
        if not step.continues and step.reads:
            retained = {k for k in step.reads if k in sim.where and k not in sim.refs}
            named = sim.name_held(step.reads)  # the lookup's run that is still held
            counters.lookup_starts += 1
        served: set[int] = set()
        # a restore reads each chunk; a lookup's reads stop at its first lost chunk
        readable = step.reads if step.continues else step.reads[:len(named)]
        for _ in step.reads:  # Belady's cursor: past every chunk this restore reads
            if advance is not None:
                advance(position)
            position += 1
        sources: dict[int, int] = {}
        for key, tier in restore_order(sim, readable):
            sim.read(key, session, promote=False)
            sources[key] = tier
            served.add(key)
            counters.block_hits[tier] += 1
            if key in step.shared:
                counters.shared_hits[tier] += 1
            if not step.continues:
                counters.lookup_blocks += 1
                counters.retained_hits += key in retained
        # promotions go in the session's chunk order, as the reader listed them
        promotions = [(key, sources[key]) for key in readable if sources.get(key, 0) > 0]
        counters.shared_reads += sum(1 for key in step.reads if key in step.shared)
        counters.read_misses += len(step.reads) - len(served)
        counters.block_reads += len(step.blocks)
        missed = [key for key in step.blocks if key not in served]
        reprefilled = sum(1 for key in missed if key in seen)
        counters.new_blocks += len(missed) - reprefilled
        counters.reprefill_blocks += reprefilled
        counters.reprefill_requests += reprefilled > 0
        if step.window_prev is not None:
            if advance is not None:
                advance(position)
            position += 1
            counters.resumes += 1
            tier = sim.read(step.window_prev, session)  # promoted at once, as the reader does
            if tier is None:
                counters.replays += 1
            else:
                counters.window_hits[tier] += 1
        for key, source in promotions:
            sim.promote(key, source, session)
        if step.blocks:
            sim.spill(step.blocks, step.prev_blocks or named, step.window_new,
                      step.window_prev, hint)
        seen.update(step.blocks)
    return counters


def restore_order(sim: TierSim, keys: Sequence[int]) -> list[tuple[int, int]]:
    """(key, tier) of each held key of a restore, in the order the manager's reader asks
    the tiers for them: batches of ``READ_BATCH`` chunks, each tier's part of a batch in
    one call, highest tier first (``TierStack.read_many``); keys no tier holds left out."""
    out = []
    for at in range(0, len(keys), READ_BATCH):
        held = [(key, sim.top(key)) for key in keys[at:at + READ_BATCH]]
        out += sorted(((k, j) for k, j in held if j is not None), key=lambda kj: kj[1])
    return out
