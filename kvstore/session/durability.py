"""Honest memory acks: a session whose write-back failed says so until it is durable.

A spill acked "in memory" queues its new chunks for write-back (``kvstore.placement.writeback``).
When one's copy to a durable tier fails (none has room, or none is available), the
session is not what its ack promised to become. ``WriteBackFailures`` then

- marks its manifest ``writeback_failed`` (``Catalog.mark_writeback_failed``: loads
  report it at once; persisted, so a restart reports it too, rather than leaving a
  DATA_LOSS nobody was told about), and counts the session
  (``Counters.writeback_failed_sessions``);
- retries the failed chunks with exponential backoff (``retry_s`` doubling up to
  ``retry_max_s``), and at once when chunks are freed (space may have returned);
- clears the mark once every failed chunk of that generation has been written back, or
  is no longer referenced (or retained). A newer spill writes a fresh, unmarked manifest; a chunk
  that is lost outright (``DataLoss``) is not retried and its session stays marked.

A job of no session (``session_id`` "": a prefix chunk written by ``WriteChunks``,
``kvstore.session.prefix_chunks``) is retried the same way, with no manifest to mark.

Marks are set in background tasks (``spawn``), never by a write-back worker, which must
not wait on a session lock that a slow restore holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from kvstore.format.errors import DataLoss, TierFull, TierUnavailable
from kvstore.placement.blocks import Blocks
from kvstore.placement.writeback import WriteBack, WriteBackQueue
from kvstore.session.catalog import Catalog
from kvstore.stats import Counters

log = logging.getLogger(__name__)

Owner = tuple[str, str, int]  # tenant, session id, generation


class WriteBackFailures:
    def __init__(self, catalog: Catalog, blocks: Blocks, counters: Counters, *,
                 spawn: Callable[[Awaitable], None], retry_s: float, retry_max_s: float,
                 depth: int, workers: int) -> None:
        """``queue``: the write-back queue (``depth`` jobs, ``workers`` at once) whose
        failures this tracks."""
        self._catalog = catalog
        self._blocks = blocks
        self._counters = counters
        self._spawn = spawn
        self._retry_s = retry_s
        self._retry_max_s = retry_max_s
        self._delay = retry_s
        self.queue = WriteBackQueue(self.write_back, depth=depth, workers=workers)
        self._open: dict[Owner, set[str]] = {}  # chunks whose write-back failed, not yet done
        self._lost: set[Owner] = set()  # sessions with a chunk no retry can bring back
        self._due: set[WriteBack] = set()  # failed jobs for the next retry round
        self._wake = asyncio.Event()
        self._retrier: asyncio.Task | None = None

    async def write_back(self, job: WriteBack) -> None:
        """The write-back queue's handler."""
        try:
            await self._blocks.write_back(job.key)
        except (TierFull, TierUnavailable, DataLoss) as exc:
            self._failed(job, retry=not isinstance(exc, DataLoss))
            raise
        self._done(job)

    def poke(self) -> None:
        """Space may have returned (chunks were freed): retry failed chunks now."""
        if self._due:
            self._delay = self._retry_s
            self._wake.set()

    async def close(self) -> None:
        if self._retrier is not None:
            self._retrier.cancel()
            await asyncio.gather(self._retrier, return_exceptions=True)
            self._retrier = None

    def _failed(self, job: WriteBack, *, retry: bool) -> None:
        owner = (job.tenant, job.session_id, job.generation)
        if not job.session_id:  # a prefix chunk of no session: retried, no one to mark
            if retry:
                self._due.add(job)
                if self._retrier is None or self._retrier.done():
                    self._retrier = asyncio.ensure_future(self._retry())
            return
        if owner not in self._open and owner not in self._lost:
            self._counters.writeback_failed_sessions += 1
            self._spawn(self._catalog.mark_writeback_failed(*owner, failed=True))
        if retry:
            self._open.setdefault(owner, set()).add(job.key)
            self._due.add(job)
            if self._retrier is None or self._retrier.done():
                self._retrier = asyncio.ensure_future(self._retry())
        else:
            self._lost.add(owner)

    def _done(self, job: WriteBack) -> None:
        owner = (job.tenant, job.session_id, job.generation)
        keys = self._open.get(owner)
        if keys is None:
            return
        keys.discard(job.key)
        if not keys:
            del self._open[owner]
            if owner not in self._lost:
                log.info("write-back of %s/%s generation %d succeeded after failing: "
                         "durable again", *owner)
                self._spawn(self._catalog.mark_writeback_failed(*owner, failed=False))
        self._delay = self._retry_s  # it worked: space is back

    async def _retry(self) -> None:
        while self._due:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._delay)
            self._wake.clear()
            self._delay = min(self._delay * 2, self._retry_max_s)
            jobs, self._due = self._due, set()
            for job in jobs:
                await self.queue.submit(job)
