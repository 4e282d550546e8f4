"""Request ids: one id per call, chosen by the client or the server, that the server's log
lines, slow-request log and trace spans carry, and that comes back in the call's trailers.

    with kvtier.request_id("checkout-42"):   # or request_id() for a fresh one
        await kv.restore("acme", "s1")       # the server logs request_id=checkout-42

Every call of a kvtier client sends ``x-kvtier-request-id``: the id of the enclosing
``request_id`` block, else a fresh one; a failed call's exception carries it as
``exc.request_id``. An id is 1 to 64 characters of ``A-Z a-z 0-9 . _ : -`` (it lands
in log lines: nothing that could forge one); the server refuses another with
INVALID_ARGUMENT and names one itself for a call that sent none.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator
from contextvars import ContextVar

from kvstore.format.errors import InvalidRequest

REQUEST_ID_KEY = "x-kvtier-request-id"
MAX_REQUEST_ID_CHARS = 64
_SAFE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_chosen: ContextVar[str | None] = ContextVar("kvtier_request_id", default=None)


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_request_id(value: str) -> str:
    """``value`` if it is a valid request id, else ``InvalidRequest`` saying why."""
    if not isinstance(value, str) or not _SAFE.fullmatch(value):
        shown = value[:80] if isinstance(value, str) else type(value).__name__
        raise InvalidRequest(f"request id {shown!r}: 1 to {MAX_REQUEST_ID_CHARS} characters "
                             "of A-Z a-z 0-9 . _ : -")
    return value


@contextlib.contextmanager
def request_id(value: str | None = None) -> Iterator[str]:
    """Calls made inside the block (this task and tasks it starts) send ``value``, or a
    fresh id; yields the id."""
    chosen = check_request_id(value) if value is not None else new_request_id()
    token = _chosen.set(chosen)
    try:
        yield chosen
    finally:
        _chosen.reset(token)


def outgoing_request_id() -> str:
    """The id the next call sends."""
    return _chosen.get() or new_request_id()
