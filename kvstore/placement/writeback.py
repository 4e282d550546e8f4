"""The bounded background write-back queue: copies of new chunks to the durable tiers.

A spill acknowledged "in memory" enqueues the keys of its new chunks here and returns; a
few worker tasks drain the queue, reading each chunk from whichever tier holds it by
then. The queue is bounded, so spills wait (back-pressure) rather than pile up unbounded
bytes in volatile tiers when the durable tier is slower than they are; its depth is
exported as a gauge. Each job names the session whose spill queued it, so a failure can
be reported on that session (``kvstore.session.durability``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

log = logging.getLogger(__name__)


class WriteBack(NamedTuple):
    """One chunk to copy to a durable tier, for the spill of ``generation`` that acked it
    (``session_id`` "": for a prefix chunk of no session)."""

    key: str
    tenant: str
    session_id: str
    generation: int


Handler = Callable[[WriteBack], Awaitable[None]]


class WriteBackQueue:
    def __init__(self, handler: Handler, *, depth: int = 256, workers: int = 2) -> None:
        if depth < 1 or workers < 1:
            raise ValueError(f"depth and workers must be >= 1, got {depth}, {workers}")
        self._handler = handler
        self._queue: asyncio.Queue[WriteBack] = asyncio.Queue(maxsize=depth)
        self._workers = [asyncio.create_task(self._work()) for _ in range(workers)]
        self.failures = 0
        self._pending = 0  # submitted and not yet written (queued, waiting or in a worker)

    @property
    def depth(self) -> int:
        """Items submitted and not yet written (including submitters waiting for room)."""
        return self._pending

    @property
    def capacity(self) -> int:
        return self._queue.maxsize

    async def submit(self, job: WriteBack) -> None:
        """Queue ``job`` for write-back; waits while the queue is full."""
        if not self._workers:
            raise RuntimeError("write-back queue is closed")
        self._pending += 1
        try:
            await self._queue.put(job)
        except BaseException:
            self._pending -= 1
            raise

    async def join(self) -> None:
        """Wait until everything submitted so far has been written (or has failed)."""
        await self._queue.join()

    async def close(self) -> None:
        """Drain the queue, then stop the workers."""
        await self.join()
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._handler(job)
            except Exception as exc:  # one bad write must not stop the worker
                self.failures += 1
                log.warning("write-back of %s (%s/%s) failed: %s", job.key, job.tenant,
                            job.session_id, exc)
            finally:
                self._pending -= 1
                self._queue.task_done()
