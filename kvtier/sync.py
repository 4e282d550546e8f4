"""``Client``: the blocking twin of ``kvtier.client.AsyncClient``, same calls, same
results, run on a private event loop in a daemon thread.

Each call has its twin's signature and docstring (``twin`` copies the docstring;
tests/client/test_public_api.py checks that every signature matches), so an editor or
``help(kvtier.Client)`` shows what the call takes."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

from kvstore.format.chunk import Buffer, LayerSlice
from kvstore.format.errors import TierUnavailable
from kvstore.format.hints import ResumeHint
from kvstore.format.layout import LayoutSpec
from kvtier import codec as cc
from kvtier.client import DEFAULT_TIMEOUT_S, AsyncClient
from kvtier.routing import RoutingPolicy
from kvtier.types import (
    DeleteResult,
    DrainProgress,
    EvictResult,
    ForkResult,
    LayoutInfo,
    PrefetchResult,
    ReadChunksResult,
    RestoredSession,
    RetryPolicy,
    SessionInfo,
    SpillResult,
    StatResult,
    TokenIds,
    WriteChunksResult,
)

Method = TypeVar("Method", bound=Callable[..., Any])
Result = TypeVar("Result")


def twin(async_method: Callable[..., Any]) -> Callable[[Method], Method]:
    """Gives the decorated blocking call the docstring of ``async_method``, its twin."""

    def documented(method: Method) -> Method:
        method.__doc__ = async_method.__doc__
        return method

    return documented



async def _cancel_others() -> None:
    """Cancel every other task on this loop and wait for them to end."""
    current = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not current]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)

class Client:
    """The blocking twin of ``AsyncClient`` (its own event loop on a daemon thread)."""

    @twin(AsyncClient.__init__)
    def __init__(self, target: str | None = None, *, servers: Sequence[str] | None = None,
                 shared_memory: bool | None = None,
                 retry: RetryPolicy = RetryPolicy(),
                 timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 max_message_bytes: int = 64 << 20, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 token: str | None = None, routing: RoutingPolicy = RoutingPolicy()) -> None:
        self._loop = asyncio.new_event_loop()
        # held while a call is handed to the loop and while closing: no call is handed to
        # a loop that will never run it (its caller would wait for ever)
        self._handing = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="kvtier-client")
        self._thread.start()

        async def make() -> AsyncClient:  # on the loop: the channels belong to it
            return AsyncClient(target, servers=servers, shared_memory=shared_memory,
                               retry=retry, timeout_s=timeout_s,
                               max_message_bytes=max_message_bytes, tls_ca=tls_ca,
                               tls_cert=tls_cert, tls_key=tls_key, token=token,
                               routing=routing)

        self._async = self._run(make())

    def _run(self, coro: Coroutine[Any, Any, Result]) -> Result:
        # in this thread's context: a kvtier.request_id block around the call applies
        context = contextvars.copy_context()

        async def in_context() -> Result:
            return await self._loop.create_task(coro, context=context)

        try:
            future = self._hand(in_context())
        except TierUnavailable:
            coro.close()
            raise
        try:
            return future.result()
        except CancelledError:
            if self._closed:
                raise TierUnavailable("this kvtier client was closed during the call") from None
            raise

    def _hand(self, coro: Coroutine[Any, Any, Result]) -> Future[Result]:
        with self._handing:
            if self._closed:
                coro.close()
                raise TierUnavailable("this kvtier client is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def async_client(self) -> AsyncClient:
        """The ``AsyncClient`` on this client's loop: its calls run through ``submit``."""
        return self._async

    def submit(self, coro: Coroutine[Any, Any, Result]) -> Future[Result]:
        """Run ``coro`` (calls of ``async_client``) on the client's loop; the caller waits
        on the future with its own deadline and may cancel it."""
        return self._hand(coro)

    @property
    def shared_memory(self) -> bool:
        """Whether chunk bytes go through shared memory (False after a fallback)."""
        return self._async.shared_memory

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @twin(AsyncClient.close)
    def close(self) -> None:
        with self._handing:
            if self._closed:
                return
            # first: a call the close ends (its channel closed, or cancelled below) then
            # reads as closed, and no call is handed to the loop from now on
            self._closed = True
        asyncio.run_coroutine_threadsafe(self._async.close(), self._loop).result()
        # calls other threads still wait on end now (cancelled), not never
        asyncio.run_coroutine_threadsafe(_cancel_others(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @twin(AsyncClient.spill)
    def spill(self, tenant: str, session_id: str, layout: str | LayoutSpec,
              token_ids: TokenIds, persistent: cc.Streams | None = None, *,
              chunks: list[bytes] | None = None, tail: bytes = b"",
              window: cc.Streams | bytes | None = None,
              generation: int, ack: str | None = None,
              hint: ResumeHint | None = None, ttl_s: float = 0.0,
              model_fingerprint: str = "", dedupe_domain: str = "") -> SpillResult:
        return self._run(self._async.spill(
            tenant, session_id, layout, token_ids, persistent, chunks=chunks, tail=tail,
            window=window, generation=generation, ack=ack, hint=hint, ttl_s=ttl_s,
            model_fingerprint=model_fingerprint, dedupe_domain=dedupe_domain))

    @twin(AsyncClient.restore)
    def restore(self, tenant: str, session_id: str, *, want_window: bool = True,
                decode: bool = True, model_fingerprint: str = "") -> RestoredSession:
        return self._run(self._async.restore(tenant, session_id, want_window=want_window,
                                             decode=decode,
                                             model_fingerprint=model_fingerprint))

    @twin(AsyncClient.resume)
    def resume(self, tenant: str, session_id: str, *, replay_tokens: int = 0,
               decode: bool = True, model_fingerprint: str = "") -> RestoredSession:
        return self._run(self._async.resume(tenant, session_id, replay_tokens=replay_tokens,
                                            decode=decode,
                                            model_fingerprint=model_fingerprint))

    @twin(AsyncClient.restore_layers)
    def restore_layers(self, tenant: str, session_id: str, *,
                       model_fingerprint: str = "") -> Iterator[LayerSlice]:
        stream = self._async.restore_layers(tenant, session_id,
                                            model_fingerprint=model_fingerprint)

        async def next_slice() -> LayerSlice:
            return await anext(stream)

        while True:
            try:
                yield self._run(next_slice())
            except StopAsyncIteration:
                return

    @twin(AsyncClient.layouts)
    def layouts(self) -> list[LayoutInfo]:
        return self._run(self._async.layouts())

    @twin(AsyncClient.register_layout)
    def register_layout(self, layout: LayoutSpec | str) -> str:
        return self._run(self._async.register_layout(layout))

    @twin(AsyncClient.layout)
    def layout(self, name_or_id: str) -> LayoutSpec:
        return self._run(self._async.layout(name_or_id))

    @twin(AsyncClient.write_chunks)
    def write_chunks(self, tenant: str, layout: str | LayoutSpec, token_ids: TokenIds,
                     chunks: Sequence[Buffer], *, first_chunk: int = 0,
                     model_fingerprint: str = "", dedupe_domain: str = "",
                     ack: str = "memory", skip_held: bool = True) -> WriteChunksResult:
        return self._run(self._async.write_chunks(
            tenant, layout, token_ids, chunks, first_chunk=first_chunk,
            model_fingerprint=model_fingerprint, dedupe_domain=dedupe_domain, ack=ack,
            skip_held=skip_held))

    @twin(AsyncClient.read_chunks)
    def read_chunks(self, tenant: str, layout: str | LayoutSpec, token_ids: TokenIds, *,
                    first_chunk: int = 0, max_chunks: int = 0, model_fingerprint: str = "",
                    dedupe_domain: str = "", digests: Sequence[bytes] | None = None,
                    use_shared_memory: bool | None = None,
                    check_digests: bool = True, in_place: bool = False
                    ) -> ReadChunksResult:
        return self._run(self._async.read_chunks(
            tenant, layout, token_ids, first_chunk=first_chunk, max_chunks=max_chunks,
            model_fingerprint=model_fingerprint, dedupe_domain=dedupe_domain,
            digests=digests, use_shared_memory=use_shared_memory,
            check_digests=check_digests, in_place=in_place))

    @twin(AsyncClient.prefetch)
    def prefetch(self, tenant: str, session_id: str, *, timeout_s: float = 0.0,
                 target_tier: str = "") -> PrefetchResult:
        return self._run(self._async.prefetch(tenant, session_id, timeout_s=timeout_s,
                                              target_tier=target_tier))

    @twin(AsyncClient.evict)
    def evict(self, tenant: str, session_id: str, target_tier: str = "") -> EvictResult:
        return self._run(self._async.evict(tenant, session_id, target_tier))

    @twin(AsyncClient.delete)
    def delete(self, tenant: str, session_id: str) -> DeleteResult:
        return self._run(self._async.delete(tenant, session_id))

    @twin(AsyncClient.lookup)
    def lookup(self, tenant: str, layout: str | LayoutSpec, token_ids: TokenIds, *,
               model: str | None = None, dedupe_domain: str = "") -> int:
        return self._run(self._async.lookup(tenant, layout, token_ids, model=model,
                                            dedupe_domain=dedupe_domain))

    @twin(AsyncClient.write_independent_chunks)
    def write_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                 token_ids: TokenIds, chunks: Sequence[bytes], *,
                                 model_fingerprint: str = "", dedupe_domain: str = "",
                                 ack: str = "memory", skip_held: bool = False
                                 ) -> WriteChunksResult:
        return self._run(self._async.write_independent_chunks(
            tenant, layout, token_ids, chunks, model_fingerprint=model_fingerprint,
            dedupe_domain=dedupe_domain, ack=ack, skip_held=skip_held))

    @twin(AsyncClient.read_independent_chunks)
    def read_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                token_ids: TokenIds, *, model_fingerprint: str = "",
                                dedupe_domain: str = "",
                                use_shared_memory: bool | None = None,
                                check_digests: bool = True, in_place: bool = False
                                ) -> ReadChunksResult:
        return self._run(self._async.read_independent_chunks(
            tenant, layout, token_ids, model_fingerprint=model_fingerprint,
            dedupe_domain=dedupe_domain, use_shared_memory=use_shared_memory,
            check_digests=check_digests, in_place=in_place))

    @twin(AsyncClient.lookup_independent_chunks)
    def lookup_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                  token_ids: TokenIds, *, model_fingerprint: str = "",
                                  dedupe_domain: str = "") -> list[bool]:
        return self._run(self._async.lookup_independent_chunks(
            tenant, layout, token_ids, model_fingerprint=model_fingerprint,
            dedupe_domain=dedupe_domain))

    @twin(AsyncClient.fork)
    def fork(self, tenant: str, source_session: str, new_session: str, *,
             upto_tokens: int) -> ForkResult:
        return self._run(self._async.fork(tenant, source_session, new_session,
                                          upto_tokens=upto_tokens))

    @twin(AsyncClient.stat)
    def stat(self, tenant: str = "", session_id: str = "", *,
             usage_of: str = "", fleet: bool = False) -> StatResult:
        return self._run(self._async.stat(tenant, session_id, usage_of=usage_of,
                                          fleet=fleet))

    @twin(AsyncClient.drain)
    def drain(self, on_progress: Callable[[DrainProgress], None] | None = None, *,
              progress_interval_s: float = 1.0) -> DrainProgress:
        return self._run(self._async.drain(on_progress,
                                           progress_interval_s=progress_interval_s))

    @twin(AsyncClient.list)
    def list(self, tenant: str = "", *, page_size: int = 0) -> list[SessionInfo]:
        return self._run(self._async.list(tenant, page_size=page_size))
