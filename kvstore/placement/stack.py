"""Where blocks live: placement with eviction, demotion, fall-through reads, promotion.

``TierStack`` moves opaque blocks (encoded chunks and window blobs) between an ordered
list of tiers, highest first. It keeps one eviction policy per tier, which doubles as
the index of what the tier holds (rebuilt from ``Tier.keys`` on open). Rules:

- A block goes to the highest tier with room; making room evicts the policy's victims,
  retained chunks first (``evict_first``). A tier whose put is refused ``TierFull``
  although its capacity has room (its medium filled first: a disk shared with other
  files) sheds retained chunks of that tier as large as the block (all of them when
  the tier reports its medium full, ``Tier.medium_full``) and retries, before the block
  goes lower or is refused.
- An evicted block moves down to the next tier that holds it already or takes it (which
  may evict there in turn); it is simply dropped only if another copy exists elsewhere.
  The last intact copy of a referenced chunk is never dropped, nor its last durable copy
  for a volatile one: the tier counts as full. A retained chunk (unreferenced) moves down
  the same way, except past a full tier whose policy ranks it below all it holds
  (``EvictionPolicy.admits``); where no tier below takes it, it is dropped from this one.
- Shared tiers (``Tier.shared``: Redis and the bucket of a fleet) may hold keys other
  nodes wrote: ``find_shared`` asks them about a key this node never saw, and
  ``find_chains`` about chain keys (a fleet's prefix lookup, ``kvstore.prefix.fleet_lookup``).
  ``share`` copies a block into the shared caches (Redis: shared, not durable) a spill
  wrote or a read passed; eviction finds it held there and moves nothing.
- Window blobs (keys under ``WINDOW_PREFIX``) only live in tiers with ``holds_window``;
  one that would have to move lower is dropped (and counted).
- A read tries the tiers believed to hold the block, highest first, then the others,
  verifying every copy (``kvstore.format.chunk.verify_chunk``) and falling through on a
  corrupt copy (one that fails the check, or that the tier itself refuses with a
  ``CodecError``, as the disk tier does for a record failing its checksum) or an
  unavailable tier, which is tried last. A read learns the copies it finds and forgets
  the ones a tier lost; ``promote`` then replaces bad copies and moves the block up.
- A tier that raised ``TierUnavailable`` is skipped for ``cooldown_s`` (a Redis outage
  costs one timeout, not one per chunk), except as a read's last resort. One that says
  ``whole_tier=False`` (a Redis Cluster master down) failed for that key alone: a miss
  or a failed write of the key, and the tier keeps serving every other key.

Every change of what a tier is believed to hold goes through ``_learn`` and ``_forget``,
which tell the ``Residency`` watcher, if any (``kvstore.session.quota`` counts memory use so).
Every mutation of one key happens under ``KeyedLocks`` held by the caller; eviction only
takes victims whose lock is free (``KeyedLocks.busy``), so it never waits on a lock.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Collection, Container, Sequence
from typing import NamedTuple

from kvstore.eviction.policies import EvictionPolicy, HintBook
from kvstore.format.chunk import verify_chunk
from kvstore.format.errors import (
    ChunkNotFound,
    CodecError,
    DataLoss,
    TierFull,
    TierUnavailable,
)
from kvstore.format.hints import ResumeHint
from kvstore.placement.events import Residency
from kvstore.placement.locks import KeyedLocks
from kvstore.stats import Counters
from kvstore.tiers.base import Buffer, Tier

WINDOW_PREFIX = "win/"
PUT_ATTEMPTS = 3  # room made by eviction can be taken by a concurrent put before ours
log = logging.getLogger(__name__)

Check = Callable[[Buffer], object]


class Copy(NamedTuple):
    """What a read found: the bytes, the tier they came from, and the tiers found
    holding a bad copy."""

    data: Buffer
    tier: int
    bad: list[int]


def intact(data: Buffer) -> bool:
    try:
        verify_chunk(data)
    except CodecError:
        return False
    return True


# Checks of a batch hashing at least this many bytes run in a worker thread: BLAKE2b (a
# chunk's digest) releases the GIL, and the event loop serves other requests meanwhile.
CHECK_IN_THREAD_BYTES = 1 << 18


async def _checked(got: list, checks: Sequence[Check], proven: Sequence[bool]) -> list:
    """``got`` with each value that fails its check replaced by the check's ``CodecError``;
    a value whose digest the tier proved gets its check's ``proven`` form where it has one
    (``kvstore.format.checks.restored_chunk_check``: all but the digest). Values whose
    checks share a ``run`` (``kvstore.format.run_checks``) are checked together by it."""
    runs: dict[int, tuple[object, list[int]]] = {}
    alone, hashed = [], 0
    for at, (value, check, sure) in enumerate(zip(got, checks, proven, strict=True)):
        if isinstance(value, Exception):
            continue
        run = getattr(check, "run", None)
        if run is not None:
            runs.setdefault(id(run), (run, []))[1].append(at)
        else:
            alone.append(at)
        hashed += 0 if sure and hasattr(check, "proven") else len(value)

    def check_all() -> list:
        out = list(got)
        for at in alone:
            check = checks[at]
            try:
                (getattr(check, "proven", check) if proven[at] else check)(got[at])
            except CodecError as exc:
                out[at] = exc
        for run, members in runs.values():
            errors = run.many([checks[at].index for at in members],  # type: ignore[attr-defined]
                              [got[at] for at in members], [proven[at] for at in members])
            for at, error in zip(members, errors, strict=True):
                if error is not None:
                    out[at] = error
        return out

    return await asyncio.to_thread(check_all) if hashed >= CHECK_IN_THREAD_BYTES else check_all()



def is_window_key(key: str) -> bool:
    return key.startswith(WINDOW_PREFIX)


def not_placed(what: str, unavailable: Sequence[TierUnavailable]) -> TierFull | TierUnavailable:
    """The error for a block no tier took (``what`` says which): ``TierUnavailable`` when
    a tier that could have taken it was out (``place``'s ``unavailable``), so an outage
    does not read as a full medium; ``TierFull`` when the tiers were truly full."""
    if unavailable:
        return TierUnavailable(f"{what}: {unavailable[0]}")
    return TierFull(what)


class _Skip:
    """Victims to pass over: locked, protected, and already found unevictable keys."""

    def __init__(self, locks: KeyedLocks, keys: set[str], protect: Collection[str]) -> None:
        self.locks, self.keys, self.protect = locks, keys, protect

    def __contains__(self, key: object) -> bool:
        return key in self.keys or key in self.protect or self.locks.busy(key)


class TierStack:
    def __init__(
        self,
        tiers: Sequence[Tier],
        policy_factory: Callable[[], EvictionPolicy],
        locks: KeyedLocks,
        counters: Counters,
        *,
        is_referenced: Callable[[str], bool],
        cooldown_s: float = 1.0,
        residency: Residency | None = None,
        evict_first: Callable[[int, Container[str]], str | None] | None = None,
        first_size: Callable[[str], int] = lambda key: 0,
    ) -> None:
        self.tiers = tuple(tiers)
        self.residency = residency
        self.policies = [policy_factory() for _ in self.tiers]
        self.locks = locks
        self.counters = counters
        self.is_referenced = is_referenced
        # (tier, keys to skip) -> a victim to take before the tier's policy is asked
        # (retained chunks, kvstore.prefix.chains.Retention), and that victim's bytes
        self.evict_first = evict_first
        self.first_size = first_size
        # predicted next uses on the policies' clock (one factory, one clock), carried
        # along when a block moves: moving is not an access by the session
        self.hints = HintBook(self.policies[0].clock)
        self.cooldown_s = cooldown_s
        self._down_until = [0.0] * len(self.tiers)  # monotonic time an outage ends
        self._down_reason = [""] * len(self.tiers)  # what the outage's first failure said

    def _learn(self, j: int, key: str, size: int = 0) -> None:
        """Tier ``j`` now holds ``key`` (``size`` bytes; 0 when listed at open)."""
        new = key not in self.policies[j]
        self.policies[j].on_insert(key, size, self.hints.get(key))
        if new and self.residency is not None:
            self.residency.held(j, key, size)

    def _forget(self, j: int, key: str) -> None:
        held = key in self.policies[j]
        self.policies[j].on_remove(key)
        if held and self.residency is not None:
            self.residency.dropped(j, key)

    def up(self, j: int) -> bool:
        return time.monotonic() >= self._down_until[j]

    def _mark_down(self, j: int, what: str, exc: TierUnavailable) -> None:
        """A call to tier ``j`` failed: skip the tier for ``cooldown_s``, unless only the
        key's part of the medium is out."""
        tier = self.tiers[j]
        self.counters.tier_errors[tier.name] += 1
        if not exc.whole_tier:
            log.debug("tier %s failed %s, for that key only: %s", tier.name, what, exc)
            return
        if self.up(j):
            self._down_reason[j] = str(exc)
            log.warning("tier %s unavailable (%s), skipping it for %.1f s: %s",
                        tier.name, what, self.cooldown_s, exc)
        self._down_until[j] = time.monotonic() + self.cooldown_s

    def index(self, tier_name: str) -> int:
        for i, tier in enumerate(self.tiers):
            if tier.name == tier_name:
                return i
        raise KeyError(tier_name)

    def holders(self, key: str) -> list[int]:
        """Tiers believed to hold ``key``, highest first."""
        return [i for i, policy in enumerate(self.policies) if key in policy]

    async def confirmed_holder(self, key: str) -> list[int]:
        """[the highest tier that really holds ``key``] or []: a belief about a tier
        that lost data (a restarted Redis) must not make a spill skip its write."""
        for j in self.holders(key):
            if not self.up(j):
                continue
            try:
                if await self.tiers[j].contains(key):
                    return [j]
            except TierUnavailable as exc:
                self._mark_down(j, "contains", exc)
                continue
            self._forget(j, key)
        return []

    async def find_shared(self, key: str) -> list[int]:
        """The shared tiers that hold ``key`` though this node did not believe so (another
        node of the fleet wrote it), asked in order (Redis's EXISTS, then the bucket's
        HEAD) until a durable one does, and learnt: a chunk named by key alone. Only
        the tiers' word: a read still verifies the bytes. Caller holds the key lock."""
        found = []
        for j, tier in enumerate(self.tiers):
            if not tier.shared or key in self.policies[j] or not self.up(j):
                continue
            try:
                if not await tier.contains(key):
                    continue
            except TierUnavailable as exc:
                self._mark_down(j, "contains", exc)
                continue
            self._learn(j, key)
            found.append(j)
            if tier.durable:
                break
        return found

    def shared_tiers(self) -> list[int]:
        """The shared tiers that can be asked by chain key (Redis, then the bucket)."""
        return [j for j, tier in enumerate(self.tiers) if tier.shared]

    async def find_chains(self, j: int, chains: Sequence[str]) -> dict[str, str]:
        """Ask shared tier ``j`` which chunk it holds for each of ``chains`` (chain keys
        this node does not know) and learn each one found: chain key -> block key. A
        tier that is down, fails, or cannot be asked so answers nothing. No key lock: a
        belief like a listing's (a read still verifies the bytes)."""
        if not chains or not self.up(j):
            return {}
        try:
            found = await self.tiers[j].find_chains(chains)
        except TierUnavailable as exc:
            self._mark_down(j, "find_chains", exc)
            return {}
        held = {}
        for chain, key in zip(chains, found or (), strict=False):
            if key is not None:
                self._learn(j, key)
                held[chain] = key
        return held

    def may_hold(self, i: int, key: str) -> bool:
        return self.tiers[i].holds_window or not is_window_key(key)

    async def load(self) -> None:
        """Learn what each tier holds now (durable tiers keep blocks across restarts)."""
        for j, tier in enumerate(self.tiers):
            try:
                async for key in tier.keys():
                    self._learn(j, key)
            except TierUnavailable as exc:
                self._mark_down(j, "listing keys", exc)

    def touch(self, key: str, hint: ResumeHint | None) -> None:
        """A session stores ``key`` now, with its resume hint (None: none given)."""
        self.hints.stored(key, hint)
        expected = self.hints.get(key)
        for i in self.holders(key):
            self.policies[i].on_access(key, expected)

    # -- placement --

    async def place(
        self, key: str, data: Buffer, *, start: int = 0, stop: int | None = None,
        protect: Collection[str] = (), unavailable: list[TierUnavailable] | None = None,
        admit: bool = False,
    ) -> int | None:
        """Put ``key`` in the highest tier of ``[start, stop)`` that holds it or takes it.

        Making room never evicts a key in ``protect`` (the rest of the session being
        placed or restored, so a session larger than a tier does not evict itself).
        ``admit``: a tier that would have to evict takes the key only if its policy
        ``admits`` it. Returns that tier's index, or None when none could.
        ``unavailable`` collects why tiers that were down (or failed the put) did not
        take it: a caller that must place the key tells "unavailable" from "full". The
        caller holds the key lock.
        """
        for j in range(start, len(self.tiers) if stop is None else stop):
            if not self.may_hold(j, key):
                continue
            if key in self.policies[j]:
                self.policies[j].on_access(key, self.hints.get(key))
                return j
            if admit and self.tiers[j].free_bytes < len(data) and not self.policies[j].admits(
                    key, len(data), self.hints.get(key)):
                continue
            if await self._put(j, key, data, protect, unavailable):
                return j
        return None

    async def share(self, key: str, data: Buffer, *, stop: int | None = None,
                    protect: Collection[str] = ()) -> None:
        """Put ``key`` in each shared tier that is a cache (Redis in a fleet: shared, not
        durable) above ``stop`` and not believed to hold it, so other nodes read it
        there. Best effort: a full or unavailable cache fails nothing (a tier in an
        outage is skipped at once). The caller holds the key lock."""
        for j in range(len(self.tiers) if stop is None else stop):
            tier = self.tiers[j]
            if tier.shared and not tier.durable and self.may_hold(j, key) \
                    and key not in self.policies[j]:
                await self._put(j, key, data, protect)

    async def _put(self, j: int, key: str, data: Buffer, protect: Collection[str] = (),
                   unavailable: list[TierUnavailable] | None = None) -> bool:
        tier, size = self.tiers[j], len(data)
        if size > tier.capacity_bytes:
            return False
        if not self.up(j):
            if unavailable is not None:
                unavailable.append(TierUnavailable(
                    f"tier {tier.name} is unavailable: {self._down_reason[j]}"))
            return False
        for _ in range(PUT_ATTEMPTS):
            if not await self._make_room(j, size, protect):
                return False
            try:
                await tier.put(key, data)
            except TierFull:  # the room was taken meanwhile, or the medium is full
                await self.shed(j, size, protect)
                continue
            except TierUnavailable as exc:
                self._mark_down(j, "put", exc)
                if unavailable is not None:
                    unavailable.append(exc)
                return False
            self._learn(j, key, size)
            self.counters.bytes_written[tier.name] += size
            return True
        return False

    async def _make_room(self, j: int, size: int, protect: Collection[str]) -> bool:
        tier, policy = self.tiers[j], self.policies[j]
        skip = _Skip(self.locks, set(), protect)
        while tier.free_bytes < size:
            first = self.evict_first if not policy.ranks_retained else None
            victim = (first and first(j, skip)) or policy.victim(skip)
            if victim is None:
                return False
            assert isinstance(victim, str)  # the stack keys its blocks by str
            skip.keys.add(victim)
            async with self.locks.hold(victim):  # immediate: victim() skipped busy keys
                await self._evict(j, victim)
        return True

    async def shed(self, j: int, size: int, protect: Collection[str] = ()) -> None:
        """Evict retained chunks of tier ``j`` until ``size`` bytes of them went (one of
        unknown size counts as ``size``): the room a full medium gives back (at once, or
        once the tier reclaims it, as the disk tier does). On a medium the tier reports
        full (``Tier.medium_full``) every retained chunk there goes: a medium that gives
        space back by whole segments frees none for a few chunks' worth of dead bytes."""
        if self.tiers[j].medium_full():
            size = sys.maxsize
        skip = _Skip(self.locks, set(), protect)
        shed = 0
        while shed < size and self.evict_first is not None:
            victim = self.evict_first(j, skip)
            if victim is None:
                return
            skip.keys.add(victim)
            amount = self.first_size(victim) or size
            async with self.locks.hold(victim):
                if await self._evict(j, victim):
                    shed += amount

    async def _evict(self, j: int, key: str) -> bool:
        """Move ``key`` out of tier ``j`` (down, or nowhere if a copy exists elsewhere)."""
        tier, window = self.tiers[j], is_window_key(key)
        if not window and not self.is_referenced(key):
            return await self._evict_retained(j, key)
        try:
            data = await tier.get(key)
        except ChunkNotFound:
            self._forget(j, key)
            return True
        except TierUnavailable as exc:
            self._mark_down(j, "eviction read", exc)
            return False
        except CodecError:  # the tier's own record check failed: nothing worth keeping
            data = None
        whole = data is not None and intact(data)
        held_below = [i for i in self.holders(key) if i > j]
        target = (await self.place(key, data, start=j + 1) if data is not None and whole
                  else None)
        # Another copy that keeps what this one gives: a durable tier's copy is only
        # replaced by another durable one (a durable ack must survive the eviction).
        elsewhere = any(i != j and (self.tiers[i].durable or not tier.durable)
                        for i in self.holders(key))
        if whole and not window and not elsewhere:
            return False  # the last (durable) copy of a referenced chunk stays
        if target is not None and target not in held_below:
            self.counters.demotions[self.tiers[target].name] += 1
        if not await self.delete(j, key, evicted=True):
            return False
        if window and target is None:
            self.window_lost()
        return True

    async def _evict_retained(self, j: int, key: str) -> bool:
        """A chunk no session names leaves tier ``j``: down to a tier below that holds it,
        has room, or admits it; else dropped (a cache entry needs no last copy)."""
        try:
            data = await self.tiers[j].get(key)
        except (ChunkNotFound, CodecError):
            data = None
        except TierUnavailable as exc:
            self._mark_down(j, "eviction read", exc)
            return False
        if data is not None and intact(data):
            held_below = [i for i in self.holders(key) if i > j]
            target = await self.place(key, data, start=j + 1, admit=True)
            if target is not None and target not in held_below:
                self.counters.demotions[self.tiers[target].name] += 1
        return await self.delete(j, key, evicted=True)

    async def demote(self, key: str, target: int,
                     unavailable: list[TierUnavailable] | None = None) -> bool:
        """Move ``key`` to tier ``target`` or lower: placed there (read, unless a copy is
        there already), then deleted from the tiers above. False when no tier there took
        it (its copies stay; ``unavailable`` as ``place``); ``DataLoss`` when no intact
        copy is left to move. Caller holds the key lock."""
        holders = self.holders(key)
        if not any(i >= target for i in holders):
            data, _, _ = await self.read(key, access=False)
            placed = await self.place(key, data, start=target, unavailable=unavailable)
            if placed is None:
                return False
            self.counters.demotions[self.tiers[placed].name] += 1
        for i in (i for i in holders if i < target):
            await self.delete(i, key, evicted=True)
        return True

    async def drop_window(self, key: str) -> None:
        """Evict window blob ``key`` from every tier (it lives in memory or nowhere);
        ``window_lost`` once no copy is left. Caller holds the key lock."""
        for i in self.holders(key):
            await self.delete(i, key, evicted=True)
        if not self.holders(key):
            self.window_lost()

    def window_lost(self) -> None:
        """Count a window blob gone or not kept (a manifest naming one that no tier
        holds loads without it: ``kvstore.session.catalog``)."""
        self.counters.windows_dropped += 1

    async def delete(self, j: int, key: str, *, evicted: bool = False) -> bool:
        """False when the tier is unavailable: the block stays (believed) held there."""
        tier = self.tiers[j]
        if not self.up(j):
            self.counters.tier_errors[tier.name] += 1
            return False
        try:
            await tier.delete(key)
        except TierUnavailable as exc:
            self._mark_down(j, f"delete of {key}", exc)
            return False
        self._forget(j, key)
        if not self.holders(key):  # its last copy: nothing left to predict (windows are
            self.hints.forget(key)  # dropped this way, and their keys never come back)
        if evicted:
            self.counters.evictions[tier.name] += 1
        return True

    async def delete_everywhere(self, key: str) -> bool:
        """Remove ``key`` from every tier (not only the believed holders); True if all did."""
        done = True
        for j in range(len(self.tiers)):
            if self.may_hold(j, key):
                done = await self.delete(j, key) and done
        self.hints.forget(key)
        return done

    async def promote(self, key: str, data: Buffer, source: int, bad: Sequence[int],
                      protect: Collection[str] = ()) -> int | None:
        """Replace bad copies above ``source`` and move ``key`` up. Caller holds the key lock."""
        for j in bad:
            if j < source:
                await self.delete(j, key)
        target = await self.place(key, data, start=0, stop=source, protect=protect)
        if target is not None and target < source:
            self.counters.promotions[self.tiers[target].name] += 1
        await self.share(key, data, stop=source, protect=protect)  # the next node's hit
        return target

    # -- reads: every copy verified, outages tried last --

    async def read(self, key: str, check: Check = verify_chunk, *, access: bool = True
                   ) -> Copy:
        """The ``Copy`` read, or ``DataLoss``.

        ``check`` raises a ``CodecError`` for bytes that must not be used. ``access``:
        a client read (counted, and recent for the policy); internal copies pass False.
        """
        (got,) = await self.read_many([key], [check], access=access)
        if isinstance(got, DataLoss):
            raise got
        return got

    async def read_many(self, keys: Sequence[str], checks: Sequence[Check], *,  # noqa: C901 - one fall-through loop over the tiers for every key at once
                        access: bool = True) -> list[Copy | DataLoss]:
        """``read`` of each key (its answer, or its ``DataLoss``), asking each tier for
        all the keys it is to be tried for in one ``Tier.get_many`` (the disk tier reads
        them in one go); the checks of a batch of many bytes run in a worker thread."""
        if access:
            self.counters.lookups += len(keys)
        believed = [self.holders(key) for key in keys]
        out_now = {j for j in range(len(self.tiers)) if not self.up(j)}  # one look at the clock
        # A key's first try is the highest tier believed to hold it when that tier is up;
        # its whole order (the other tiers, outages last) is made only if that try fails.
        fast = [bool(held) and held[0] not in out_now for held in believed]
        orders = [[held[0]] if quick else self._order(key, held, out_now)
                  for key, held, quick in zip(keys, believed, fast, strict=True)]
        out: list = [None] * len(keys)
        tried = [0] * len(keys)
        bad: list[list[int]] = [[] for _ in keys]
        problems: list[list[str]] = [[] for _ in keys]
        unreachable = [False] * len(keys)  # a tier tried for it was unavailable
        pending = list(range(len(keys)))
        while pending:
            by_tier: dict[int, list[int]] = {}
            for i in pending:
                order = orders[i]
                if fast[i] and tried[i] == len(order):
                    fast[i] = False
                    order = orders[i] = self._order(keys[i], believed[i], out_now)
                if tried[i] < len(order):
                    by_tier.setdefault(order[tried[i]], []).append(i)
                    continue
                if access:
                    self.counters.misses += 1
                found = "; ".join(problems[i]) or "no tier holds it"
                out[i] = DataLoss(f"no intact copy of {keys[i]}: {found}", corrupt=bool(bad[i]),
                                  unavailable=unreachable[i])
            pending = []
            for j, batch in sorted(by_tier.items()):
                got, proven = await self.tiers[j].get_many_proven([keys[i] for i in batch])
                got = await _checked(got, [checks[i] for i in batch], proven)
                answered: list[tuple[int, Buffer]] = []  # (i, good bytes) this tier gave
                for i, value, sure in zip(batch, got, proven, strict=True):
                    tried[i] += 1
                    if not isinstance(value, Exception):
                        if not sure and hasattr(checks[i], "proven"):
                            self.tiers[j].note_proven(keys[i], value)  # its digest just held
                        answered.append((i, value))
                        out[i] = Copy(value, j, bad[i])
                        continue
                    unreachable[i] |= isinstance(value, TierUnavailable)
                    self._failed(j, keys[i], value, believed[i], bad[i], problems[i])
                    pending.append(i)
                self._found(j, [(keys[i], value, j in believed[i]) for i, value in answered],
                            access)
        return out

    def _order(self, key: str, held: list[int], out_now: set[int]) -> list[int]:
        """Every tier to try for ``key``: those believed to hold it, highest first, then
        the others that may, the ones out now last."""
        order = held + [i for i in range(len(self.tiers))
                        if i not in held and self.may_hold(i, key)]
        down = [j for j in order if j in out_now]
        for j in down:
            if j in held:  # skipped, unless nothing else answers
                self.counters.fallthrough_unavailable[self.tiers[j].name] += 1
        return [j for j in order if j not in down] + down

    def _found(self, j: int, found: list[tuple[str, Buffer, bool]], access: bool) -> None:
        """Account for tier ``j``'s good answers, (key, bytes, whether ``j`` was believed
        to hold it) each, at once: one hint, counter and policy update per batch."""
        if not found:
            return
        tier = self.tiers[j]
        if access:
            read = [key for key, _, _ in found]
            self.hints.read_many(read)
            self.counters.hits[tier.name] += len(found)
            self.counters.bytes_read[tier.name] += sum(len(value) for _, value, _ in found)
            held = [key for key, _, believed in found if believed]
            self.policies[j].on_access_many(held, self.hints.get_many(held))
        for key, value, believed in found:
            if not believed:
                self._learn(j, key, len(value))

    def _failed(self, j: int, key: str, got: Exception, believed: list[int],
                bad: list[int], problems: list[str]) -> None:
        """Account for tier ``j``'s failed answer to a read of ``key`` (why it has no
        good bytes); the read falls through to the next tier."""
        tier = self.tiers[j]
        if isinstance(got, ChunkNotFound):
            if j in believed:
                self._forget(j, key)
            return
        if isinstance(got, TierUnavailable):
            if self.up(j):
                self.counters.fallthrough_unavailable[tier.name] += 1
            problems.append(f"{tier.name} unavailable")
            self._mark_down(j, f"read of {key}", got)
            return
        if isinstance(got, CodecError):  # from the check, or the tier's own record check
            self.counters.fallthrough_corrupt[tier.name] += 1
            problems.append(f"{tier.name} corrupt ({got})")
            log.error("corrupt copy of %s in tier %s, falling through: %s", key, tier.name, got)
            bad.append(j)
            return
        raise got
