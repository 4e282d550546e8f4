"""kvstore errors <-> gRPC status codes, at the servicer boundary and in the client only.

The server sends the exception's class name in the ``kvtier-error`` trailing metadata,
so the client raises the very class the store raised (``StaleGeneration``, not just
"FAILED_PRECONDITION"); the status code alone decides when that name is absent.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from kvstore import errors as kverrors
from kvstore.errors import KVTierError

log = logging.getLogger(__name__)
ERROR_KEY = "kvtier-error"

# Most specific first: the first isinstance match decides.
_TO_STATUS: tuple[tuple[type[KVTierError], grpc.StatusCode], ...] = (
    (kverrors.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (kverrors.NotFound, grpc.StatusCode.NOT_FOUND),
    (kverrors.TierFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (kverrors.StaleGeneration, grpc.StatusCode.FAILED_PRECONDITION),
    (kverrors.DataLoss, grpc.StatusCode.DATA_LOSS),
    (kverrors.CodecError, grpc.StatusCode.DATA_LOSS),
    (kverrors.TierUnavailable, grpc.StatusCode.UNAVAILABLE),
    (kverrors.Busy, grpc.StatusCode.ABORTED),
)

_FROM_STATUS: dict[grpc.StatusCode, type[KVTierError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: kverrors.InvalidRequest,
    grpc.StatusCode.NOT_FOUND: kverrors.SessionNotFound,
    # Our own RESOURCE_EXHAUSTED always names TierFull; without a name it is gRPC's
    # refusal of a message over the size limit: the request was too big.
    grpc.StatusCode.RESOURCE_EXHAUSTED: kverrors.InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: kverrors.StaleGeneration,
    grpc.StatusCode.DATA_LOSS: kverrors.DataLoss,
    grpc.StatusCode.UNAVAILABLE: kverrors.TierUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: kverrors.TierUnavailable,
    grpc.StatusCode.ABORTED: kverrors.Busy,
}


class PreconditionFailed(KVTierError):
    """The session's state (or the server's set-up) forbids the operation as asked."""


class MissingChunks(PreconditionFailed):
    """A spill left out chunks the server does not hold: send them and spill again."""


class SharedMemoryUnavailable(kverrors.InvalidRequest):
    """A shared-memory segment named in a call cannot be mapped here: the two sides do
    not share a host (or /dev/shm). Clients fall back to sending bytes inline."""


class ServerError(KVTierError):
    """The server failed in a way no specific error describes (INTERNAL, UNKNOWN...)."""


_BY_NAME: dict[str, type[KVTierError]] = {
    cls.__name__: cls
    for cls in (*vars(kverrors).values(), PreconditionFailed, MissingChunks,
                SharedMemoryUnavailable, ServerError)
    if isinstance(cls, type) and issubclass(cls, KVTierError)
}


def status_for(exc: KVTierError) -> grpc.StatusCode:
    if isinstance(exc, PreconditionFailed):
        return grpc.StatusCode.FAILED_PRECONDITION
    for cls, code in _TO_STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode, details: str, name: str | None = None) -> KVTierError:
    """The exception a client raises for a failed call."""
    cls = _BY_NAME.get(name or "") or _FROM_STATUS.get(code, ServerError)
    return cls(f"{code.name}: {details}")


def error_from_rpc(exc: grpc.RpcError) -> KVTierError:
    trailing = dict(exc.trailing_metadata() or ())
    return error_for(exc.code(), exc.details() or "", trailing.get(ERROR_KEY))


async def _abort(servicer, method: str, context: grpc.aio.ServicerContext,
                 exc: BaseException) -> None:
    if isinstance(exc, KVTierError):
        code, name = status_for(exc), type(exc).__name__
        if code == grpc.StatusCode.INTERNAL:
            log.exception("unexpected store error", exc_info=exc)
    else:
        log.error("unexpected error in an RPC", exc_info=exc)
        code, name = grpc.StatusCode.INTERNAL, type(exc).__name__
    record = getattr(servicer, "record_error", None)
    if record is not None:
        record(method, code)
    context.set_trailing_metadata(((ERROR_KEY, name),))
    await context.abort(code, str(exc) or name)


def grpc_errors(method):
    """Wrap a servicer method (coroutine or async generator): errors become statuses,
    reported to the servicer's ``record_error(method, code)`` when it has one."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for reply in method(self, request, context):
                    yield reply
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # a status for every failure, never a crashed stream
                await _abort(self, method.__name__, context, exc)

        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a status for every failure, never a crashed server
            await _abort(self, method.__name__, context, exc)

    return unary
