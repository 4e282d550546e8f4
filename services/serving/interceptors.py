"""Every server interceptor wraps a method's calls the same way: authentication and audit
(``services.serving.auth``), request ids and logs (``services.server.requests``), the
calls in flight the loop monitor names (``services.server.loop_lag``). ``scoped`` does it
once: the handler's behaviour runs inside ``scope(request, context)``, an async context
manager that sees the call begin, and end with its exception if any (the request: a
message, or the iterator of a client stream).

grpc.aio tells coroutines from async generators, so the wrapped behaviour keeps its
handler's kind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

Scope = Callable[[Any, grpc.aio.ServicerContext], AbstractAsyncContextManager[object]]


def scoped(handler: grpc.RpcMethodHandler, scope: Scope) -> grpc.RpcMethodHandler:
    """``handler`` with each call run inside ``scope(request, context)``."""
    wrapped: Callable[..., Any]
    if handler.response_streaming:
        kind = "stream_stream" if handler.request_streaming else "unary_stream"
        behaviour = getattr(handler, kind)

        async def within_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            async with scope(request, context):
                async for reply in behaviour(request, context):
                    yield reply

        wrapped = within_stream
    else:
        kind = "stream_unary" if handler.request_streaming else "unary_unary"
        behaviour = getattr(handler, kind)

        async def within(request: Any, context: Any) -> Any:
            async with scope(request, context):
                return await behaviour(request, context)

        wrapped = within
    # a namedtuple at run time: grpc's stubs leave out its _replace
    replaced: grpc.RpcMethodHandler = handler._replace(  # type: ignore[attr-defined]
        **{kind: wrapped})
    return replaced
