"""Blocking calls to a remote dependency (boto3's S3 client) with a total deadline, a
bounded pool of threads and the dependency's circuit breaker.

    calls = BlockingCalls(CircuitBreaker("object"), deadline_s=15.0, max_threads=16,
                          is_outage=lambda exc: isinstance(exc, BotoCoreError))
    result = await calls.run("GET", client.get_object, Bucket=..., Key=...)

``run`` fails fast (``TierUnavailable``, nothing sent) while the breaker is open;
otherwise it waits for one of the pool's ``max_threads`` threads and runs the call
there, all within ``deadline_s`` (a burst larger than the pool queues; a pool whose
threads all stay busy past the deadline is ``TierUnavailable``). A call that outlives
its deadline raises ``TierUnavailable`` and opens the breaker; its thread cannot be
stopped, so it keeps its slot until the call returns (the client's own connect and
read timeouts bound that): stalled calls never hold more than ``max_threads`` threads.
An exception the call raises is re-raised as it is; ``is_outage`` says whether it
counts against the breaker (an outage) or not (the dependency's answer, e.g. a
missing key).

Every call is timed from ``run`` to its end and reported to ``self.observer``
(``kvstore.remote.observe``) under ``op_name(what)``, with its error's kind when it
failed: ``timeout``, ``unavailable`` (the breaker was open) or what ``kind_of(exc)`` says
of the exception the call raised (None: an answer, not an error; default: ``other`` for
an outage).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvstore.format.errors import TierUnavailable
from kvstore.remote.breaker import CircuitBreaker
from kvstore.remote.observe import IGNORE, op_name

T = TypeVar("T")


class BlockingCalls:
    def __init__(self, breaker: CircuitBreaker, *, deadline_s: float, max_threads: int,
                 is_outage: Callable[[BaseException], bool],
                 kind_of: Callable[[BaseException], str | None] | None = None) -> None:
        if deadline_s <= 0 or max_threads < 1:
            raise ValueError("deadline_s must be > 0 and max_threads >= 1")
        self.breaker, self.deadline_s, self.max_threads = breaker, deadline_s, max_threads
        self.is_outage = is_outage
        self.kind_of = kind_of or (lambda exc: "other" if is_outage(exc) else None)
        self.observer = IGNORE
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix=breaker.dependency)
        self._slots = asyncio.Semaphore(max_threads)  # a thread each, held until it returns
        self.busy = 0  # threads running a call, finished or not by its deadline

    async def run(self, what: str, function: Callable[..., T], *args: object,
                  **kwargs: object) -> T:
        started = time.perf_counter()
        failed: list[str | None] = [None]
        try:
            return await self._run(failed, what, function, *args, **kwargs)
        except asyncio.CancelledError:
            failed[0] = None  # the caller gave up: no error of the dependency
            raise
        except BaseException as exc:
            if failed[0] is None:
                failed[0] = self.kind_of(exc)
            raise
        finally:
            kind = failed[0]
            op, dependency = op_name(what), self.breaker.dependency
            self.observer.request(dependency, op, time.perf_counter() - started)
            if kind is not None:
                self.observer.error(dependency, op, kind)

    async def _run(self, failed: list[str | None], what: str, function: Callable[..., T],
                   *args: object, **kwargs: object) -> T:
        """The call; ``failed[0]`` says how it failed when it was not the call's own
        exception."""
        failed[0] = "unavailable"
        self.breaker.check()  # open: fail fast; half-open: this call is the probe
        failed[0] = "timeout"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        try:
            await asyncio.wait_for(self._slots.acquire(), self.deadline_s)
        except TimeoutError:
            self.breaker.cancelled()  # no answer was waited for: not the dependency's
            raise TierUnavailable(f"{self.breaker.dependency} {what}: all "
                                  f"{self.max_threads} connections stayed busy for "
                                  f"{self.deadline_s:g} s") from None
        except BaseException:
            self.breaker.cancelled()
            raise
        failed[0] = None
        self.busy += 1
        try:
            future = loop.run_in_executor(self._pool, functools.partial(function, *args,
                                                                        **kwargs))
        except BaseException:
            self._free()
            raise
        future.add_done_callback(lambda _: self._free())
        try:
            # shield: a timeout must not cancel the future (that would free the slot of
            # a thread still running)
            result = await asyncio.wait_for(asyncio.shield(future),
                                            max(0.0, deadline - loop.time()))
        except TimeoutError:
            failed[0] = "timeout"
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

    def _free(self) -> None:
        self.busy -= 1
        self._slots.release()

    def close(self) -> None:
        """Let the pool's threads end once their calls return (never waits for them)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _consume(future: asyncio.Future) -> None:
    """Retrieve the late result of a call nobody waits for (no 'never retrieved' log)."""
    if not future.cancelled():
        future.exception()
