"""Block moves that spill, restore and maintenance share, each under its key's lock.

``TierStack`` leaves three things to its callers, and ``Blocks`` does them once: holding
the key's lock (``KeyedLocks``) around every mutation, freeing a chunk only when the
``RefLedger`` counts no reference (or pin) to it (``release`` lets ``Retention`` keep the
held ones as cache first), and copying chunks to a durable tier. A spill's chunks are
placed (``store``) or confirmed (``reference``) here, and its window (``place_window``).
``gather`` bounds how many moves run at once (``ManagerConfig.io_concurrency``, shared
by every call of one manager).

``admitting`` is the one admission of chunks: every write that stores them (a spill, a
WriteChunks) names their dedupe domain there, once its checks proved their keys and
before any is placed, to the ``WriteHook`` (the encrypting tiers' domain claims,
``kvstore.encryption.claims``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvstore.format.errors import DataLoss, TierUnavailable
from kvstore.format.hints import ResumeHint
from kvstore.placement.events import Keeper, StoreEvents
from kvstore.placement.locks import KeyedLocks
from kvstore.placement.refcount import RefLedger
from kvstore.placement.stack import Check, TierStack, not_placed
from kvstore.stats import Counters
from kvstore.tiers.base import Buffer

log = logging.getLogger(__name__)


class ChunkOutcome(NamedTuple):
    """What placing (or finding) one chunk of a spill came to."""

    needs_writeback: bool  # not on a durable tier yet, and there is one
    size: int  # encoded bytes
    held: bool  # deduped: some tier held it already


@dataclass(frozen=True)
class BlockWrite:
    """The chunks one write brings in or names (window blobs live in memory tiers only,
    sealed nowhere): every key's chain part is proven, by the write's own checks, to be
    the one its tokens chain to under ``scope`` (``kvstore.format.keys``), so a write can
    only name blocks of its own domain."""

    scope: str  # kvstore.format.keys.dedupe_scope
    layout_hash: int
    keys: tuple[str, ...]


class WriteHook(Protocol):
    """Told of every write that stores chunks: ``before`` anything of it is placed,
    ``after`` it ended, stored or refused (``in_use``: whether a block is still pinned,
    referenced or retained)."""

    def before(self, write: BlockWrite) -> None: ...

    def after(self, write: BlockWrite, in_use: Callable[[str], bool]) -> None: ...


class Blocks:
    def __init__(self, stack: TierStack, ledger: RefLedger, locks: KeyedLocks,
                 counters: Counters, *, io_concurrency: int, retention: Keeper,
                 events: StoreEvents | None = None, hook: WriteHook | None = None) -> None:
        """``retention``: keeps chunks left unreferenced as cache (or says to free them);
        ``events``: told when a free made room; ``hook``: told of every write
        (``admitting``)."""
        self._hook = hook
        self._stack = stack
        self._retention = retention
        self._events = events
        self._ledger = ledger
        self._locks = locks
        self._counters = counters
        self._io = asyncio.Semaphore(io_concurrency)
        self.durable = [i for i, tier in enumerate(stack.tiers) if tier.durable]

    @contextlib.contextmanager
    def admitting(self, write: BlockWrite) -> Iterator[None]:
        """Around a write that stores chunks, once its checks proved its keys: the hook
        learns their domain before any is placed, and settles after, however it ended."""
        if self._hook is None:
            yield
            return
        self._hook.before(write)
        try:
            yield
        finally:
            self._hook.after(write, self._in_use)

    def _in_use(self, key: str) -> bool:
        return bool(self._ledger.count(key)) or self._retention.retained(key)

    async def gather(self, coros: Iterable[Coroutine]) -> list:
        """Run ``coros`` at most ``io_concurrency`` at a time; on failure cancel the rest."""
        async def bounded(coro: Coroutine):
            async with self._io:
                return await coro

        coros = list(coros)
        tasks = [asyncio.ensure_future(bounded(c)) for c in coros]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for coro in coros:
                coro.close()  # those cancelled before they started
            raise

    async def free(self, keys: Sequence[str]) -> int:
        """Delete unreferenced ``keys`` from every tier; how many this call freed."""
        async def free(key: str) -> bool:
            async with self._locks.hold(key):
                if self._ledger.count(key):
                    return False  # referenced again (or pinned by a spill) meanwhile
                held = bool(self._stack.holders(key))  # False: another call freed it first
                await self._stack.delete_everywhere(key)
                self._counters.freed_chunks += held
                return held

        freed = sum(await self.gather(free(key) for key in dict.fromkeys(keys)))
        if freed and self._events is not None:
            self._events.freed()
        return freed

    async def release(self, keys: Iterable[str], scope: str = "",
                      sizes: Mapping[str, int] | None = None) -> int:
        """Let go of chunks whose last reference (or pin) just went away: the held ones
        retention keeps (in dedupe domain ``scope``, ``sizes`` where known), the rest are
        freed (``free``)."""
        return await self.free(self._retention.keep(keys, scope, sizes))

    async def drop(self, key: str) -> None:
        """Delete ``key`` from every tier whatever references it (window blobs)."""
        async with self._locks.hold(key):
            await self._stack.delete_everywhere(key)

    async def shed_durable(self, size: int) -> None:
        """Evict about ``size`` bytes of retained chunks from each durable tier: what a
        metadata commit refused for a full medium gives back (``Catalog.put``)."""
        for j in self.durable:
            await self._stack.shed(j, size)

    def any_durable(self, tiers: Iterable[int]) -> bool:
        return any(self._stack.tiers[i].durable for i in tiers)

    async def copy_to_durable(self, key: str, data: Buffer,
                              unavailable: list[TierUnavailable] | None = None) -> bool:
        """Put ``key`` in the first durable tier that holds or takes it; False if none
        did (``unavailable`` collects the outages among them, as ``TierStack.place``).
        The caller holds the key's lock."""
        for j in self.durable:
            if await self._stack.place(key, data, start=j, stop=j + 1,
                                       unavailable=unavailable) is not None:
                return True
        return False

    async def write_back(self, key: str) -> None:
        """The write-back queue's handler: copy a chunk acked "in memory" to a durable
        tier (a session's, or one kept as cache: a prefix chunk), unless it was freed or
        reached one since it was queued."""
        async with self._locks.hold(key):
            if not self._ledger.count(key) and not self._retention.retained(key):
                return  # freed, or its spill failed, since it was queued
            if self.any_durable(self._stack.holders(key)):
                return
            try:
                data, _, _ = await self._stack.read(key, access=False)
            except DataLoss:
                self._counters.writeback_failed += 1
                raise
            unavailable: list[TierUnavailable] = []
            assert data is not None  # read above for the durable ack
            if await self.copy_to_durable(key, data, unavailable):
                self._counters.writeback_done += 1
                return
            self._counters.writeback_failed += 1
            raise not_placed(f"no durable tier took chunk {key} for write-back", unavailable)

    async def reference(self, key: str, size: int | None, check: Check,
                        hint: ResumeHint | None, *, durable_ack: bool) -> ChunkOutcome | None:
        """A chunk a spill names by key only: None when no tier holds it intact. Its
        bytes are read only when its size is unknown (not in the session's last manifest)
        or a durable ack must copy it."""
        async with self._locks.hold(key):
            self._stack.touch(key, hint)
            # one another node of the fleet wrote: Redis or the bucket knows it
            if not (await self._stack.confirmed_holder(key)
                    or await self._stack.find_shared(key)):
                return None
            durable = self.any_durable(self._stack.holders(key))
            data = None
            if size is None or (durable_ack and not durable):
                try:
                    data, _, _ = await self._stack.read(key, check, access=False)
                except DataLoss:
                    return None
                size = len(data)
            self._counters.dedupe_hits += 1
            if durable:
                return ChunkOutcome(False, size, True)
            if not durable_ack:
                return ChunkOutcome(bool(self.durable), size, True)
            unavailable: list[TierUnavailable] = []
            assert data is not None  # read above for the durable ack
            if await self.copy_to_durable(key, data, unavailable):
                return ChunkOutcome(False, size, True)
            raise not_placed(f"no durable tier took chunk {key} ({size} B)", unavailable)

    async def store(self, key: str, data: Buffer, hint: ResumeHint | None,
                    protect: frozenset[str], start: int, *, durable_ack: bool) -> ChunkOutcome:
        """Place one chunk a spill sent in tier ``start`` or lower, never evicting one of
        ``protect`` (or find it held, the very bytes: the key binds their digest). With
        ``durable_ack``, a chunk this call placed whose durable copy fails is deleted
        again (the write fails; nothing of it stays visible)."""
        async with self._locks.hold(key):
            self._stack.touch(key, hint)
            holders = await self._stack.confirmed_holder(key)
            held = bool(holders)
            unavailable: list[TierUnavailable] = []  # outages, told apart from full tiers
            if held:
                self._counters.dedupe_hits += 1
            else:
                placed = await self._stack.place(key, data, protect=protect, start=start,
                                                 unavailable=unavailable)
                if placed is None:
                    raise not_placed(f"no tier has room for chunk {key} ({len(data)} B)",
                                     unavailable)
                holders = [placed]
            durable = self.any_durable(holders)
            if durable or not durable_ack:
                await self._share(key, data, protect)
                return ChunkOutcome(not durable and bool(self.durable), len(data), held)
            try:
                copied, _ = await asyncio.gather(  # the bucket and Redis at once; both end here
                    self.copy_to_durable(key, data, unavailable),
                    self._share(key, data, protect), return_exceptions=True)
                if isinstance(copied, BaseException):
                    raise copied
                if not copied:
                    raise not_placed(f"no durable tier took chunk {key} ({len(data)} B)",
                                     unavailable)
            except BaseException:
                # a durable write failed is never acknowledged: the copies this call
                # placed go, so no lookup or read finds them meanwhile
                if not held:
                    await self._stack.delete_everywhere(key)
                raise
            return ChunkOutcome(False, len(data), held)

    async def _share(self, key: str, data: Buffer, protect: frozenset[str]) -> None:
        """Write the chunk through to the fleet's shared cache (Redis; nothing on a single
        node), so other nodes read it there: it is a cache, its failure fails nothing."""
        try:
            await self._stack.share(key, data, protect=protect)
        except Exception as exc:  # noqa: BLE001 - TierStack.share handles the tiers' own
            log.warning("write-through of chunk %s to the shared cache failed: %r", key, exc)

    async def place_window(self, key: str, data: Buffer, hint: ResumeHint | None
                           ) -> int | None:
        """Place window blob ``key`` in the highest window tier with room; its index, or
        None when none had room."""
        async with self._locks.hold(key):
            self._stack.touch(key, hint)
            return await self._stack.place(key, data)
