"""The event loop's lag, measured for as long as the server runs: a task that asks to
wake every ``TICK_S`` records how late it woke (``kvtier_event_loop_lag_seconds``); a
tick later than ``STALL_S`` is a stall (``kvtier_event_loop_stalls_total``), logged as a
warning naming the RPCs that ran during it. Every call runs on this one loop, so a stall
delays all of them: no client input may cause one (``services.server.sizes`` bounds
what a request makes the loop parse).

    monitor = LoopMonitor(metrics)
    interceptors = [monitor.interceptor(), ...]
    monitor.start()                      # on the server's loop
    ...
    await monitor.stop()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.server.metrics import ServiceMetrics
from services.serving.lifecycle import end_task

log = logging.getLogger(__name__)
TICK_S = 0.01
STALL_S = 0.05


class LoopMonitor:
    """The lag monitor of one server; ``max_lag_s``: the latest tick seen."""

    def __init__(self, metrics: ServiceMetrics, tick_s: float = TICK_S,
                 stall_s: float = STALL_S) -> None:
        self.metrics = metrics
        self.tick_s, self.stall_s = tick_s, stall_s
        self.max_lag_s = 0.0
        self.stalls = 0
        self.running: Counter[str] = Counter()  # method -> calls in flight
        self._seen: set[str] = set()  # methods in flight during the current tick
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await end_task(self._task)
        self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._seen = set(self.running)
            due = loop.time() + self.tick_s
            cpu = time.thread_time()
            await asyncio.sleep(self.tick_s)
            self.observe(max(0.0, loop.time() - due), time.thread_time() - cpu)

    def observe(self, lag_s: float, busy_s: float = 0.0) -> None:
        """One tick ``lag_s`` late, ``busy_s`` of it on the loop thread's CPU (the rest:
        waiting for a core or the GIL, which work on the loop does not explain)."""
        self.metrics.loop_lag_seconds.observe(lag_s)
        self.max_lag_s = max(self.max_lag_s, lag_s)
        if lag_s > self.stall_s:
            self.stalls += 1
            self.metrics.loop_stalls.inc()
            log.warning("event loop stalled %.0f ms (over %.0f ms; %.0f ms of it running on "
                        "the loop); RPCs in flight: %s", lag_s * 1e3, self.stall_s * 1e3,
                        busy_s * 1e3, ", ".join(sorted(self._seen)) or "none")

    def entered(self, method: str) -> None:
        self.running[method] += 1
        self._seen.add(method)

    def left(self, method: str) -> None:
        self.running[method] -= 1
        if not self.running[method]:
            del self.running[method]

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """Counts every call in flight by method, for the stall warnings."""
        return _InFlight(self)


class _InFlight(grpc.aio.ServerInterceptor):
    def __init__(self, monitor: LoopMonitor) -> None:
        self.monitor = monitor

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        return _tracked(handler, self.monitor, details.method.rpartition("/")[2])


def _tracked(handler: grpc.RpcMethodHandler, monitor: LoopMonitor, name: str
             ) -> grpc.RpcMethodHandler:
    """``handler`` counted in flight while it runs, of the same kind (grpc.aio tells
    coroutines from async generators)."""
    if handler.response_streaming:
        kind = "stream_stream" if handler.request_streaming else "unary_stream"
        behaviour = getattr(handler, kind)

        async def tracked_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            monitor.entered(name)
            try:
                async for reply in behaviour(request, context):
                    yield reply
            finally:
                monitor.left(name)

        wrapped: Callable[..., Any] = tracked_stream
    else:
        kind = "stream_unary" if handler.request_streaming else "unary_unary"
        behaviour = getattr(handler, kind)

        async def tracked(request: Any, context: Any) -> Any:
            monitor.entered(name)
            try:
                return await behaviour(request, context)
            finally:
                monitor.left(name)

        wrapped = tracked
    # a namedtuple at run time: grpc's stubs leave out its _replace
    replaced: grpc.RpcMethodHandler = handler._replace(  # type: ignore[attr-defined]
        **{kind: wrapped})
    return replaced
