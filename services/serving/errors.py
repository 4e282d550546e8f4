"""The one place the servers' errors meet gRPC: ``grpc_errors`` turns an exception into a
status code and the ``kvtier-error`` trailer by the table in ``kvstore.format.errors``
(the client's ``kvtier.errors.error_from_rpc`` turns them back into the exception);
``add_servicer`` registers a servicer so bytes that do not parse as its request type are
INVALID_ARGUMENT (gRPC itself answers UNKNOWN, or fails inside a client stream).

What a client reads is bounded and path-free: the details are clipped to
``MAX_DETAILS_BYTES`` (gRPC carries them in metadata, refused past 16 KiB) and anything
that looks like an absolute path becomes ``<path>``; the full message is logged here.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import grpc
from google.protobuf.message import DecodeError

from kvstore.format.errors import (
    ERROR_KEY,
    InvalidRequest,
    KVTierError,
    error_name,
    status_name,
)

log = logging.getLogger(__name__)
Handler = TypeVar("Handler", bound=Callable[..., Awaitable | AsyncIterator])
MAX_DETAILS_BYTES = 2048  # of UTF-8; percent-encoded in grpc-message, at most 3x that
# An absolute path: a "/" that starts a word (not "tenant/session", "s3://b/k", "../x").
_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\",:;()<>\[\]{}]+")


@runtime_checkable
class RecordsCalls(Protocol):
    """A servicer that counts its calls by final status and times them (the kvtier
    server's metrics): errors where the call is aborted (``abort``, also for calls that
    never reached the handler), successes and latency where the handler ends."""

    def record_error(self, method: str, code: grpc.StatusCode) -> None: ...

    def record_done(self, method: str, seconds: float, ok: bool) -> None: ...


def status_for(exc: BaseException) -> grpc.StatusCode:
    return grpc.StatusCode[status_name(exc)]


def client_message(message: str) -> str:
    """``message`` as a client may read it: no absolute paths, at most MAX_DETAILS_BYTES."""
    message = _PATH.sub("<path>", message)
    raw = message.encode()
    if len(raw) <= MAX_DETAILS_BYTES:
        return message
    return raw[:MAX_DETAILS_BYTES - 20].decode(errors="ignore") + f"... ({len(raw)} B)"


async def abort(context: grpc.aio.ServicerContext, exc: BaseException,
                servicer: object = None, method: str = "") -> None:
    """End the call with ``exc``'s status and name (reported to the servicer's
    ``record_error(method, code)`` when it has one)."""
    code = status_for(exc)
    message = str(exc) if isinstance(exc, KVTierError) else f"{type(exc).__name__}: {exc}"
    message = message or type(exc).__name__
    shown = client_message(message)
    if code == grpc.StatusCode.INTERNAL:
        log.error("unexpected error in %s", method or "an RPC", exc_info=exc)
    elif shown != message:  # the operator sees what the client does not
        log.warning("%s in %s: %s", code.name, method or "an RPC", message)
    if isinstance(servicer, RecordsCalls):
        servicer.record_error(method, code)
    # kept beside the error's name: the request id the server set at the call's start
    kept = tuple((k, v) for k, v in (context.trailing_metadata() or ()) if k != ERROR_KEY)
    context.set_trailing_metadata((*kept, (ERROR_KEY, error_name(exc))))
    await context.abort(code, shown)


class _Timed:
    """One call's record: its latency and, when no error was recorded, its OK."""

    def __init__(self, servicer: object, method: str) -> None:
        self.servicer, self.method = servicer, method
        self.started = time.perf_counter()
        self.ok = False

    def cancelled(self) -> None:  # the client went away: no abort, so count it here
        if isinstance(self.servicer, RecordsCalls):
            self.servicer.record_error(self.method, grpc.StatusCode.CANCELLED)

    def done(self) -> None:
        if isinstance(self.servicer, RecordsCalls):
            self.servicer.record_done(self.method, time.perf_counter() - self.started,
                                      self.ok)


def grpc_errors(method: Handler) -> Handler:  # noqa: C901 - the wrappers of the two handler kinds, with their failure cases
    """Wrap a servicer method (coroutine or async generator): every failure becomes a
    status (never a crashed stream or server); every call is counted and timed."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            call = _Timed(self, method.__name__)
            try:
                async for reply in method(self, request, context):
                    yield reply
                call.ok = True
            except grpc.aio.AbortError:
                raise
            except (asyncio.CancelledError, GeneratorExit):
                call.cancelled()
                raise
            except Exception as exc:
                await abort(context, exc, self, method.__name__)
            finally:
                call.done()

        return cast(Handler, stream)  # functools.wraps keeps no signature for mypy

    @functools.wraps(method)
    async def unary(self, request, context):
        call = _Timed(self, method.__name__)
        try:
            reply = await method(self, request, context)
            call.ok = True
            return reply
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:
            call.cancelled()
            raise
        except Exception as exc:
            await abort(context, exc, self, method.__name__)
        finally:
            call.done()

    return cast(Handler, unary)


class Undecodable:
    """What a tolerant deserializer hands the handler for bytes that are not its type."""

    def __init__(self, type_name: str, error: DecodeError) -> None:
        self.error = InvalidRequest(f"the request is not a valid {type_name}: {error}")


def _tolerant(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    type_name = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "message"

    def read(raw: bytes) -> object:
        try:
            return deserialize(raw)
        except DecodeError as exc:
            return Undecodable(type_name, exc)

    return read


async def _decoded(requests: AsyncIterator) -> AsyncIterator:
    """A client stream that raises InvalidRequest at its first undecodable message."""
    async for request in requests:
        if isinstance(request, Undecodable):
            raise request.error
        yield request


def _guarded(handler: grpc.RpcMethodHandler, servicer: object, name: str
             ) -> grpc.RpcMethodHandler:
    """``handler`` with a tolerant deserializer and a behaviour that refuses its marker
    (grpc.aio tells coroutines and async generators from sync code: keep their kinds)."""
    kind = _KINDS[handler.request_streaming, handler.response_streaming]
    guarded = _GUARDS[kind](getattr(handler, kind), servicer, name)
    assert handler.request_deserializer is not None  # a generated handler has one
    # a namedtuple at run time; grpc's stubs leave out its _replace
    replaced: grpc.RpcMethodHandler = handler._replace(  # type: ignore[attr-defined]
        request_deserializer=_tolerant(handler.request_deserializer), **{kind: guarded})
    return replaced


# (request streaming, response streaming) -> the handler's behaviour attribute
_KINDS = {(True, True): "stream_stream", (True, False): "stream_unary",
          (False, True): "unary_stream", (False, False): "unary_unary"}
Behaviour = Callable[..., Any]


def _stream_stream(behaviour: Behaviour, servicer: object, name: str) -> Behaviour:
    async def guarded(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for reply in behaviour(_decoded(requests), context):
            yield reply

    return guarded


def _stream_unary(behaviour: Behaviour, servicer: object, name: str) -> Behaviour:
    async def guarded(requests: AsyncIterator[Any], context: Any) -> Any:
        return await behaviour(_decoded(requests), context)

    return guarded


def _unary_stream(behaviour: Behaviour, servicer: object, name: str) -> Behaviour:
    async def guarded(request: Any, context: Any) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await abort(context, request.error, servicer, name)
        async for reply in behaviour(request, context):
            yield reply

    return guarded


def _unary_unary(behaviour: Behaviour, servicer: object, name: str) -> Behaviour:
    async def guarded(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            await abort(context, request.error, servicer, name)
        return await behaviour(request, context)

    return guarded


_GUARDS = {"stream_stream": _stream_stream, "stream_unary": _stream_unary,
           "unary_stream": _unary_stream, "unary_unary": _unary_unary}


class _Captured:
    """Stands in for a server to catch the handlers a generated ``add_*_to_server`` adds."""

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str,
                                       handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(add: Callable[[object, object], None], servicer: object,
                 server: grpc.aio.Server) -> None:
    """``add(servicer, server)`` (a generated ``add_*Servicer_to_server``), with every
    method answering INVALID_ARGUMENT to request bytes that do not parse."""
    captured = _Captured()
    add(servicer, captured)
    handlers = {name: _guarded(handler, servicer, name)
                for name, handler in captured.handlers.items()}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(captured.service, handlers),))
    server.add_registered_method_handlers(captured.service, handlers)
