"""``Client``: the blocking twin of ``kvtier.client.AsyncClient``, same calls, same
results, run on a private event loop in a daemon thread."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Coroutine, Iterator, Sequence
from concurrent.futures import Future

import numpy as np

from kvstore.format.chunk import LayerSlice
from kvstore.format.layout import LayoutSpec
from kvtier.client import AsyncClient
from kvtier.types import (
    LayoutInfo,
    ReadChunksResult,
    RestoredSession,
    SpillResult,
    WriteChunksResult,
)
from proto import kvtier_pb2 as pb


class Client:
    """The blocking twin of ``AsyncClient`` (its own event loop on a daemon thread)."""

    def __init__(self, target: str | None = None, **options) -> None:
        """As ``AsyncClient``: ``target`` (one server) or ``servers=[...]`` (routed)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="kvtier-client")
        self._thread.start()
        self._async = self._run(self._make(target, options))

    async def _make(self, target: str | None, options: dict) -> AsyncClient:
        return AsyncClient(target, **options)

    def _run(self, coro):
        # in this thread's context: a kvtier.request_id block around the call applies
        context = contextvars.copy_context()

        async def in_context():
            return await self._loop.create_task(coro, context=context)

        return asyncio.run_coroutine_threadsafe(in_context(), self._loop).result()

    @property
    def async_client(self) -> AsyncClient:
        """The ``AsyncClient`` on this client's loop: its calls run through ``submit``."""
        return self._async

    def submit(self, coro: Coroutine) -> Future:
        """Run ``coro`` (calls of ``async_client``) on the client's loop; the caller waits
        on the future with its own deadline and may cancel it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def shared_memory(self) -> bool:
        """Whether chunk bytes go through shared memory (False after a fallback)."""
        return self._async.shared_memory

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def spill(self, *args, **kwargs) -> SpillResult:
        return self._run(self._async.spill(*args, **kwargs))

    def restore(self, *args, **kwargs) -> RestoredSession:
        return self._run(self._async.restore(*args, **kwargs))

    def resume(self, *args, **kwargs) -> RestoredSession:
        return self._run(self._async.resume(*args, **kwargs))

    def restore_layers(self, tenant: str, session_id: str, **kwargs) -> Iterator[LayerSlice]:
        stream = self._async.restore_layers(tenant, session_id, **kwargs)
        while True:
            try:
                yield self._run(stream.__anext__())
            except StopAsyncIteration:
                return

    def layouts(self) -> list[LayoutInfo]:
        return self._run(self._async.layouts())

    def register_layout(self, layout) -> str:
        return self._run(self._async.register_layout(layout))

    def layout(self, name_or_id: str):
        return self._run(self._async.layout(name_or_id))

    def prefetch(self, *args, **kwargs) -> pb.PrefetchReply:
        return self._run(self._async.prefetch(*args, **kwargs))

    def evict(self, *args, **kwargs) -> pb.EvictReply:
        return self._run(self._async.evict(*args, **kwargs))

    def delete(self, *args, **kwargs) -> pb.DeleteReply:
        return self._run(self._async.delete(*args, **kwargs))

    def lookup(self, *args, **kwargs) -> int:
        return self._run(self._async.lookup(*args, **kwargs))

    def write_chunks(self, *args, **kwargs) -> WriteChunksResult:
        return self._run(self._async.write_chunks(*args, **kwargs))

    def read_chunks(self, *args, **kwargs) -> ReadChunksResult:
        return self._run(self._async.read_chunks(*args, **kwargs))

    def write_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                 token_ids: Sequence[int] | np.ndarray, chunks: Sequence[bytes],
                                 *, model_fingerprint: str = "", dedupe_domain: str = "",
                                 ack: str = "memory", skip_held: bool = False
                                 ) -> WriteChunksResult:
        return self._run(self._async.write_independent_chunks(
            tenant, layout, token_ids, chunks, model_fingerprint=model_fingerprint,
            dedupe_domain=dedupe_domain, ack=ack, skip_held=skip_held))

    def read_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                token_ids: Sequence[int] | np.ndarray, *,
                                model_fingerprint: str = "", dedupe_domain: str = "",
                                use_shared_memory: bool | None = None,
                                check_digests: bool = True, in_place: bool = False
                                ) -> ReadChunksResult:
        return self._run(self._async.read_independent_chunks(
            tenant, layout, token_ids, model_fingerprint=model_fingerprint,
            dedupe_domain=dedupe_domain, use_shared_memory=use_shared_memory,
            check_digests=check_digests, in_place=in_place))

    def lookup_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                  token_ids: Sequence[int] | np.ndarray, *,
                                  model_fingerprint: str = "", dedupe_domain: str = ""
                                  ) -> list[bool]:
        return self._run(self._async.lookup_independent_chunks(
            tenant, layout, token_ids, model_fingerprint=model_fingerprint,
            dedupe_domain=dedupe_domain))

    def fork(self, *args, **kwargs) -> pb.ForkReply:
        return self._run(self._async.fork(*args, **kwargs))

    def stat(self, *args, **kwargs) -> pb.StatReply:
        return self._run(self._async.stat(*args, **kwargs))

    def drain(self, *args, **kwargs) -> pb.DrainProgress:
        return self._run(self._async.drain(*args, **kwargs))

    def list(self, *args, **kwargs) -> list[pb.SessionInfo]:
        return self._run(self._async.list(*args, **kwargs))
