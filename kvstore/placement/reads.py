"""Fall-through reads of a ``TierStack``: every copy verified, outages tried last.

A read tries the tiers believed to hold the block, highest first, then the others,
verifying every copy (``kvstore.format.chunk.verify_chunk``) and falling through on a
corrupt copy (one that fails the check, or that the tier itself refuses with a
``CodecError``, as the disk tier does for a record failing its checksum) or an
unavailable tier, which is tried last. A read learns the copies it finds and forgets
the ones a tier lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvstore.format.chunk import verify_chunk
from kvstore.format.errors import ChunkNotFound, CodecError, DataLoss, TierUnavailable
from kvstore.tiers.base import Buffer

if TYPE_CHECKING:
    from kvstore.eviction.policies import EvictionPolicy, HintBook
    from kvstore.stats import Counters
    from kvstore.tiers.base import Tier

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


class Reads:
    """The read half of ``kvstore.placement.stack.TierStack``."""

    tiers: tuple[Tier, ...]
    policies: list[EvictionPolicy]
    counters: Counters
    hints: HintBook

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

    async def read_many(self, keys: Sequence[str], checks: Sequence[Check], *,
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
        tried, bad = [0] * len(keys), [[] for _ in keys]
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
                found = []  # (i, value) of the keys this tier answered with good bytes
                for i, value, sure in zip(batch, got, proven, strict=True):
                    tried[i] += 1
                    if not isinstance(value, Exception):
                        if not sure and hasattr(checks[i], "proven"):
                            self.tiers[j].note_proven(keys[i], value)  # its digest just held
                        found.append((i, value))
                        out[i] = Copy(value, j, bad[i])
                        continue
                    unreachable[i] |= isinstance(value, TierUnavailable)
                    self._failed(j, keys[i], value, believed[i], bad[i], problems[i])
                    pending.append(i)
                self._found(j, [(keys[i], value, j in believed[i]) for i, value in found],
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
