"""kvtier's errors on the client side: ``error_from_rpc`` turns a failed call back into the
exception the server raised, by the table in ``kvstore.format.errors`` (the server's
``services.serving.errors.grpc_errors`` turns an exception into a status code and the
``kvtier-error`` trailer by the same table). Every class of the one hierarchy is
re-exported here.

    try:
        await client.restore("t", "s1")
    except kvtier.SessionNotFound:
        ...
"""

from __future__ import annotations

import grpc

from kvstore.format import errors as store_errors
from kvstore.format.errors import *  # noqa: F403  (every class of the one hierarchy)
from kvstore.format.errors import ERROR_KEY, KVTierError, error_for
from kvtier.request_ids import REQUEST_ID_KEY

__all__ = [*store_errors.__all__, "client_deadline_passed", "error_from_rpc"]


def client_deadline_passed(exc: grpc.aio.AioRpcError) -> bool:
    """The call's own deadline ran out: the node did not answer in time (a server that
    ends a call DEADLINE_EXCEEDED itself names its error class in the trailer)."""
    if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
        return False
    return ERROR_KEY not in dict(exc.trailing_metadata() or ())


def error_from_rpc(exc: grpc.RpcError, source: str = "") -> KVTierError:
    """The exception a failed call stands for; ``source`` prefixes its message (who failed)."""
    # (key, value) pairs: the stubs type the metadata of grpc's sync API instead
    trailing: dict[str, str | bytes] = dict(
        exc.trailing_metadata() or ())  # type: ignore[arg-type]
    name, request_id = trailing.get(ERROR_KEY), trailing.get(REQUEST_ID_KEY)
    error = error_for(exc.code().name, source + (exc.details() or ""),
                      name if isinstance(name, str) else None)
    error.request_id = request_id if isinstance(request_id, str) else None  # kvtier.request_ids
    return error
