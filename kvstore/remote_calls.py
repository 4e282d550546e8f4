"""Blocking calls to a remote dependency (boto3's S3 client) with a total deadline, a
bounded pool of threads and the dependency's circuit breaker.

    calls = BlockingCalls(CircuitBreaker("object"), deadline_s=15.0, max_threads=16,
                          is_outage=lambda exc: isinstance(exc, BotoCoreError))
    result = await calls.run("GET", client.get_object, Bucket=..., Key=...)

``run`` fails fast (``TierUnavailable``, nothing sent) while the breaker is open or while
every thread of the pool is still busy with an earlier call; otherwise it runs the call
in the pool and waits at most ``deadline_s``. A call that outlives its deadline raises
``TierUnavailable`` and opens the breaker; its thread cannot be stopped, so it keeps
its slot until the call returns (the client's own connect and read timeouts bound
that): stalled calls never hold more than ``max_threads`` threads. An exception the
call raises is re-raised as it is; ``is_outage`` says whether it counts against the
breaker (an outage) or not (the dependency's answer, e.g. a missing key).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvstore.breaker import CircuitBreaker
from kvstore.errors import TierUnavailable

T = TypeVar("T")


class BlockingCalls:
    def __init__(self, breaker: CircuitBreaker, *, deadline_s: float, max_threads: int,
                 is_outage: Callable[[BaseException], bool]) -> None:
        if deadline_s <= 0 or max_threads < 1:
            raise ValueError("deadline_s must be > 0 and max_threads >= 1")
        self.breaker, self.deadline_s, self.max_threads = breaker, deadline_s, max_threads
        self.is_outage = is_outage
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix=breaker.dependency)
        self.busy = 0  # threads running a call, finished or not by its deadline

    async def run(self, what: str, function: Callable[..., T], *args: object,
                  **kwargs: object) -> T:
        if self.busy >= self.max_threads:
            # nothing would start before a stalled call returns: do not queue behind it
            raise TierUnavailable(f"{self.breaker.dependency} {what}: all {self.max_threads} "
                                  "connections are waiting on earlier calls")
        self.breaker.check()  # after the pool's check: a half-open probe must get a thread
        self.busy += 1
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self._pool, functools.partial(function, *args,
                                                                        **kwargs))
        except BaseException:
            self.busy -= 1
            raise
        future.add_done_callback(self._freed)
        try:
            # shield: a timeout must not cancel the future (that would free the slot of
            # a thread still running)
            result = await asyncio.wait_for(asyncio.shield(future), self.deadline_s)
        except TimeoutError:
            future.add_done_callback(_consume)
            message = (f"{self.breaker.dependency} {what} did not answer within "
                       f"{self.deadline_s:g} s")
            self.breaker.failed(message)
            raise TierUnavailable(message) from None
        except asyncio.CancelledError:
            future.add_done_callback(_consume)
            self.breaker.cancelled()
            raise
        except BaseException as exc:
            if self.is_outage(exc):
                self.breaker.failed(f"{what}: {exc!r}")
            else:
                self.breaker.succeeded()
            raise
        self.breaker.succeeded()
        return result

    def _freed(self, _future: asyncio.Future) -> None:
        self.busy -= 1

    def close(self) -> None:
        """Let the pool's threads end once their calls return (never waits for them)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _consume(future: asyncio.Future) -> None:
    """Retrieve the late result of a call nobody waits for (no 'never retrieved' log)."""
    if not future.cancelled():
        future.exception()
