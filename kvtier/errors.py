"""kvtier's errors, and the one place they meet gRPC: the servers' ``grpc_errors`` turns
an exception into a status code and the ``kvtier-error`` trailer, ``error_from_rpc``
turns a failed call back into the exception, both by the table in ``kvstore.errors``.

    try:
        await client.restore("t", "s1")
    except kvtier.SessionNotFound:
        ...
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar, runtime_checkable

import grpc

from kvstore.errors import (
    ERROR_KEY,
    Busy,
    ChunkCorrupt,
    ChunkNotFound,
    ChunksNotHeld,
    ChunkTruncated,
    CodecError,
    DataLoss,
    InvalidRequest,
    KVTierError,
    LayoutMismatch,
    MissingChunks,
    NotFound,
    PreconditionFailed,
    ServerError,
    SessionNotFound,
    SharedMemoryUnavailable,
    StaleGeneration,
    TierFull,
    TierUnavailable,
    UnknownLayout,
    UnsupportedVersion,
    error_for,
    error_name,
    status_name,
)

__all__ = [
    "ERROR_KEY", "Busy", "ChunkCorrupt", "ChunkNotFound", "ChunkTruncated", "ChunksNotHeld",
    "CodecError", "DataLoss", "InvalidRequest", "KVTierError", "LayoutMismatch",
    "MissingChunks", "NotFound", "PreconditionFailed", "ServerError", "SessionNotFound",
    "SharedMemoryUnavailable", "StaleGeneration", "TierFull", "TierUnavailable",
    "UnknownLayout", "UnsupportedVersion", "error_from_rpc", "grpc_errors", "status_for",
]

log = logging.getLogger(__name__)
Handler = TypeVar("Handler", bound=Callable[..., Awaitable | AsyncIterator])


@runtime_checkable
class RecordsErrors(Protocol):
    """A servicer that counts its failed calls (the kvtier server's metrics)."""

    def record_error(self, method: str, code: grpc.StatusCode) -> None: ...


def status_for(exc: BaseException) -> grpc.StatusCode:
    return grpc.StatusCode[status_name(exc)]


def error_from_rpc(exc: grpc.RpcError, source: str = "") -> KVTierError:
    """The exception a failed call stands for; ``source`` prefixes its message (who failed)."""
    trailing = dict(exc.trailing_metadata() or ())
    return error_for(exc.code().name, source + (exc.details() or ""), trailing.get(ERROR_KEY))


async def abort(context: grpc.aio.ServicerContext, exc: BaseException,
                servicer: object = None, method: str = "") -> None:
    """End the call with ``exc``'s status and name (reported to the servicer's
    ``record_error(method, code)`` when it has one)."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("unexpected error in %s", method or "an RPC", exc_info=exc)
    if isinstance(servicer, RecordsErrors):
        servicer.record_error(method, code)
    message = str(exc) if isinstance(exc, KVTierError) else f"{type(exc).__name__}: {exc}"
    context.set_trailing_metadata(((ERROR_KEY, error_name(exc)),))
    await context.abort(code, message or type(exc).__name__)


def grpc_errors(method: Handler) -> Handler:
    """Wrap a servicer method (coroutine or async generator): every failure becomes a
    status (never a crashed stream or server)."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for reply in method(self, request, context):
                    yield reply
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort(context, exc, self, method.__name__)

        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, exc, self, method.__name__)

    return unary
