"""The bounded background write-back queue: copies of new chunks to the durable tiers.

A spill acknowledged "in memory" enqueues the keys of its new chunks here and returns; a
few worker tasks drain the queue, reading each chunk from whichever tier holds it by
then. The queue is bounded, so spills wait (back-pressure) rather than pile up unbounded
bytes in volatile tiers when the durable tier is slower than they are; its depth is
exported as a gauge.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Handler = Callable[[str], Awaitable[None]]


class WriteBackQueue:
    def __init__(self, handler: Handler, *, depth: int = 256, workers: int = 2) -> None:
        if depth < 1 or workers < 1:
            raise ValueError(f"depth and workers must be >= 1, got {depth}, {workers}")
        self._handler = handler
        self._queue: asyncio.Queue[str] = asyncio.Queue(maxsize=depth)
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

    async def submit(self, key: str) -> None:
        """Queue ``key`` for write-back; waits while the queue is full."""
        if not self._workers:
            raise RuntimeError("write-back queue is closed")
        self._pending += 1
        try:
            await self._queue.put(key)
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
            key = await self._queue.get()
            try:
                await self._handler(key)
            except Exception:  # one bad write must not stop the worker; the handler logs
                self.failures += 1
                log.exception("write-back of %s failed", key)
            finally:
                self._pending -= 1
                self._queue.task_done()
