"""Draining a node before it stops (``kvtier drain``): once it starts, the node takes no new
session state, every memory-acked session reaches a durable tier, and in a fleet the
windows it holds move to live peers (or, where none takes one, are released), so the node
can stop (even be killed) without a session lost and without routers sending anything
to it.

The steps, in order, each reported as ``DrainProgress``:

1. ``writes``: new writes (spills, forks, prefix chunk writes, adopted windows) are
   refused with ``TierUnavailable`` saying the node is draining (UNAVAILABLE: a routed
   client sends the call to another node at once, a single-node client retries until
   the node is back), and rebuilt windows are not kept; the writes admitted before run
   to their commit.
2. ``writeback``: the write-back queue empties (memory-acked chunks on a durable tier).
   A session whose write-back failed is counted; the drain waits for the retries,
   which clear the mark once its chunks are durable.
3. ``windows`` (shared metadata only): each session whose window this node holds, under
   its write lock here: the blob is read (checked against the layout and the token ids)
   and handed to ``move`` (the server's: a live peer's ``AdoptWindow``, which keeps it
   in its memory and rewrites the manifest naming itself, compare-and-swap); once a peer
   took it, the blob here is freed and the session resumes there without replay
   (``windows_moved``). A window no peer took (none live, each refused, the session
   spilled meanwhile, the blob evicted) is released as before: the manifest rewritten
   without it (compare-and-swap), the blob freed, and the session's next resume replays
   on the node a router picks (``windows_released``). On a single node windows do not
   outlive the process either way; they are counted.

A drain is one-way: the node stays draining until it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

from kvstore.format.checks import window_check
from kvstore.format.errors import DataLoss, KVTierError, StaleGeneration, TierUnavailable
from kvstore.format.registry import get_layout
from kvstore.session.context import StoreContext
from kvstore.session.manifest import SessionManifest
from kvstore.tiers.base import Buffer

log = logging.getLogger(__name__)
# Hands a window this node holds (the manifest, the checked blob) to a live peer: whether
# one adopted it (the manifest names that peer now). Errors are the mover's to log.
WindowMove = Callable[[SessionManifest, Buffer], Awaitable[bool]]


@dataclass(frozen=True)
class DrainProgress:
    phase: str  # writes, writeback, windows, done
    writes_in_flight: int  # admitted before the drain, not yet committed
    writeback_pending: int  # chunks queued for write-back
    writeback_failed: int  # sessions marked writeback_failed
    windows_held: int  # sessions whose window this node holds (still to move or release)
    windows_released: int  # no peer took them: their sessions replay elsewhere
    windows_moved: int  # a live peer adopted them: their sessions resume there as they were

    @property
    def done(self) -> bool:
        return self.phase == "done"


class Draining:
    """The node's drain state: ``admitting`` guards each write, ``run`` drains."""

    def __init__(self, store: StoreContext, settle: Callable[[], Awaitable[None]]) -> None:
        """``settle``: waits for the background work a write started (the manager's
        promotions); the write-back queue is watched here."""
        self._store = store
        self._settle = settle
        self.active = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._released = 0
        self._moved = 0
        self._held = 0
        self.move: WindowMove | None = None  # a fleet server's (None: windows are released)
        self._one = asyncio.Lock()  # a second drain runs once the first is through

    @contextlib.contextmanager
    def admitting(self, what: str) -> Iterator[None]:
        """Around a write that stores session state: refused once draining."""
        if self.active:
            raise TierUnavailable(f"this node is draining: {what} refused, send it to "
                                  "another node (a routed client does) or retry once the "
                                  "node is back")
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    def progress(self, phase: str) -> DrainProgress:
        return DrainProgress(phase, self._in_flight, self._store.durability.queue.depth,
                             self._store.catalog.writeback_failed_count, self._held,
                             self._released, self._moved)

    async def run(self, interval_s: float = 1.0) -> AsyncIterator[DrainProgress]:
        """Start draining (a second call waits for the first, then finds it done) and
        report each step, and every ``interval_s`` while one waits, until done."""
        self.active = True
        yield self.progress("writes")
        async with self._one:
            async for step in self._steps(interval_s):
                yield step

    async def _steps(self, interval_s: float) -> AsyncIterator[DrainProgress]:
        while not await _waited(self._idle.wait(), interval_s):
            yield self.progress("writes")
        queue = self._store.durability.queue
        while True:
            settled = await _waited(self._settle(), interval_s)
            if settled and not queue.depth and not self._store.catalog.writeback_failed_count:
                break
            if settled:  # only failed write-backs left: their retries run on a timer
                await asyncio.sleep(interval_s)
            yield self.progress("writeback")
        if self._store.catalog.meta.node_id:  # shared metadata: a fleet node
            mine = [(m.tenant, m.session_id, m.window_key)
                    for m in await self._store.catalog.manifests() if m.window_key is not None]
            self._held = len(mine)
            yield self.progress("windows")
            for tenant, session_id, key in mine:
                if await self._move(tenant, session_id):
                    self._moved += 1
                else:
                    self._released += await self._release(tenant, session_id, key)
                self._held -= 1
            log.info("drain: %d windows moved to peers, %d released (their sessions replay "
                     "elsewhere)", self._moved, self._released)
        else:
            self._held = sum(1 for m in await self._store.catalog.manifests() if m.window_key)
        yield self.progress("done")

    async def _move(self, tenant: str, session_id: str) -> bool:
        """Hand the session's window to a live peer (``move``) and free it here once one
        adopted it; whether one did. Under the session's write lock, so nothing here
        rewrites the manifest between the read and the peer's compare-and-swap."""
        if self.move is None:
            return False
        catalog = self._store.catalog
        async with catalog.write(tenant, session_id):
            manifest = await catalog.load(tenant, session_id)
            if manifest is None or manifest.window_key is None:
                return False
            check = window_check(get_layout(manifest.layout_id), manifest.token_ids)
            try:
                data = (await self._store.stack.read(manifest.window_key, check,
                                                     access=False)).data
            except DataLoss:
                return False  # evicted (or corrupt) since the load: nothing to move
            if not await self.move(manifest, data):
                return False
            await self._store.blocks.drop(manifest.window_key)
        return True

    async def _release(self, tenant: str, session_id: str, key: str) -> bool:
        """Rewrite the session's manifest without the window this node holds (``key``),
        then free the blob; whether it did. A session spilled again meanwhile by another
        node names that node, and the blob here, no session's any more, is freed too."""
        catalog = self._store.catalog
        async with catalog.write(tenant, session_id):
            try:
                manifest = await catalog.load(tenant, session_id)
                if manifest is None or manifest.window_key != key:
                    await self._store.blocks.drop(key)  # deleted, or moved on elsewhere
                    return False
                await catalog.put(manifest.evolve(window_tier=None, window_key=None,
                                                  window_replayed=0))
            except StaleGeneration:
                # another node wrote a newer generation: its window, not ours
                await self._store.blocks.drop(key)
                return False
            except KVTierError as exc:
                log.warning("drain: the window of %s/%s not released: %s", tenant,
                            session_id, exc)
                raise
            await self._store.blocks.drop(key)
        return True


async def _waited(awaitable: Awaitable[object], timeout_s: float) -> bool:
    """True once ``awaitable`` finished within ``timeout_s`` (it keeps running if not)."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if task in done:
        task.result()
        return True
    task.cancel()
    return False
