"""How the server gets a discarded window rebuilt: in its own process, or on remote
``kvtier replay-worker`` processes through the ``Replay`` gRPC service.

Both present one call, ``await rebuilder.rebuild(spec, token_ids, chunks, tail, R)``,
returning the encoded window (the codec's ephemeral chunk) and what it cost.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from kvstore.errors import InvalidRequest, TierUnavailable
from kvstore.layout import LayoutSpec
from kvstore.tiers.base import Buffer
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.config import ServerConfig
from services.errors import error_from_rpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebuiltWindow:
    window: bytes  # codec chunk, ephemeral streams
    replayed_tokens: int
    seconds: float
    worker: str


class Rebuilder(Protocol):
    async def rebuild(self, spec: LayoutSpec, token_ids: np.ndarray, chunks: Sequence[Buffer],
                      tail: bytes, replay_tokens: int) -> RebuiltWindow: ...

    async def close(self) -> None: ...


class RemoteRebuilder:
    """Round-robin over worker addresses; a worker that is down hands the job to the next."""

    def __init__(self, addresses: Sequence[str], *, max_message_bytes: int,
                 timeout_s: float = 120.0) -> None:
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        self._channels = [grpc.aio.insecure_channel(a, options=options) for a in addresses]
        self._stubs = [pb_grpc.ReplayStub(c) for c in self._channels]
        self._addresses = list(addresses)
        self._next = itertools.cycle(range(len(addresses)))
        self._timeout_s = timeout_s

    async def rebuild(self, spec: LayoutSpec, token_ids: np.ndarray, chunks: Sequence[Buffer],
                      tail: bytes, replay_tokens: int) -> RebuiltWindow:
        request = pb.ReplayRequest(
            layout_id=spec.layout_id, token_ids=token_ids.astype("<u4").tobytes(),
            chunks=[bytes(c) for c in chunks], tail=tail, replay_tokens=replay_tokens,
            job_id=uuid.uuid4().hex)
        failures = []
        for _ in range(len(self._stubs)):
            i = next(self._next)
            try:
                reply = await self._stubs[i].Rebuild(request, timeout=self._timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    failures.append(f"{self._addresses[i]}: {exc.code().name}")
                    continue
                raise error_from_rpc(exc) from exc
            return RebuiltWindow(reply.window, reply.replayed_tokens, reply.seconds,
                                 reply.worker or self._addresses[i])
        raise TierUnavailable(f"no replay worker answered: {'; '.join(failures)}")

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))


class InProcessRebuilder:
    """The replay package's service in this process (model weights loaded once, lazily)."""

    def __init__(self, service) -> None:
        self._service = service

    async def rebuild(self, spec: LayoutSpec, token_ids: np.ndarray, chunks: Sequence[Buffer],
                      tail: bytes, replay_tokens: int) -> RebuiltWindow:
        started = time.perf_counter()
        call = self._service.rebuild
        args = (spec, token_ids, [bytes(c) for c in chunks], tail, replay_tokens)
        result = (await call(*args) if inspect.iscoroutinefunction(call)
                  else await asyncio.to_thread(call, *args))
        window = getattr(result, "window", result)
        replayed = getattr(result, "replayed_tokens", min(replay_tokens, len(token_ids)))
        return RebuiltWindow(bytes(window), int(replayed), time.perf_counter() - started,
                             "in-process")

    async def close(self) -> None:
        close = getattr(self._service, "close", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                await result


def make_rebuilder(config: ServerConfig) -> Rebuilder | None:
    """The configured rebuilder, or None (Resume then refuses sessions needing replay)."""
    mode = config.replay_mode
    if mode == "remote":
        return RemoteRebuilder(config.replay_workers, max_message_bytes=config.max_message_bytes)
    if mode == "off":
        return None
    try:
        replay = importlib.import_module("replay")
    except ImportError:
        return None
    service_class = getattr(replay, "ReplayService", None)
    if service_class is None:
        log.warning("replay package has no ReplayService: Resume cannot rebuild windows")
        return None
    try:
        return InProcessRebuilder(service_class())
    except InvalidRequest as exc:
        log.warning("in-process replay unavailable: %s", exc)
        return None
