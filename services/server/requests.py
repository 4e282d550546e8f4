"""Requests an operator can follow: a request id per call, one log line per RPC at debug
level, a slow-request log, and log lines as JSON objects (``log_format = "json"``).

``RequestInterceptor`` takes the call's ``x-kvtier-request-id`` (``kvtier.request_ids``;
one that is not a valid id is refused INVALID_ARGUMENT, none gets a fresh one), puts it
in the trailers at once (so an error's trailers carry it too) and keeps a ``Request`` in
a context variable while the handler runs. Handlers add what the line should say
(``note(tenant=..., session=..., tier=..., bytes=..., replay_tokens=...)``) and time
their phases (``with phase("read"):``). When the call ends:

- at debug level, one line: method, request id, status, milliseconds and the notes;
- at or above ``slow_request_s`` (0: off), one warning line with the same and the time
  of every phase.

``RequestFields`` adds ``request_id``, ``tenant`` and ``session`` to every log record
made inside a call, and ``JsonFormatter`` writes a record as one JSON object a line.
Nothing secret is noted: tokens and keys never reach a Request. With ``tracing``
(``services.server.tracing``) the traced calls get a span, their phases child spans.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from kvstore.format.errors import InvalidRequest
from kvtier.request_ids import REQUEST_ID_KEY, check_request_id, new_request_id
from services.serving.interceptors import scoped

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from services.server.tracing import Tracing

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
log = logging.getLogger(__name__)
_current: ContextVar[Request | None] = ContextVar("kvtier_request", default=None)


@dataclass
class Request:
    request_id: str
    method: str
    started: float = field(default_factory=time.perf_counter)
    notes: dict[str, object] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # name -> seconds, summed
    tracing: Tracing | None = None
    span: Span | None = None  # the call's span, when it is traced

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        if self.span is not None and self.tracing is not None:
            self.tracing.phase(self.span, name, seconds)

    def summary(self, code: str) -> dict[str, object]:
        return {"method": self.method, "request_id": self.request_id, "code": code,
                "ms": round((time.perf_counter() - self.started) * 1000, 3), **self.notes,
                **({"phases_ms": {k: round(v * 1000, 3) for k, v in self.phases.items()}}
                   if self.phases else {})}


def current() -> Request | None:
    return _current.get()


def note(**fields: object) -> None:
    """Add ``fields`` to the current call's log lines (nothing outside a call)."""
    request = _current.get()
    if request is not None:
        request.notes.update(fields)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time a phase of the current call (summed when it runs several times)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        request = _current.get()
        if request is not None:
            request.add_phase(name, time.perf_counter() - started)


def record_phase(name: str, seconds: float) -> None:
    """Add a phase timed elsewhere (a replay reports its own seconds)."""
    request = _current.get()
    if request is not None:
        request.add_phase(name, seconds)


class RequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, slow_request_s: float, tracing: Tracing | None = None) -> None:
        self.slow_request_s = slow_request_s
        self.tracing = tracing

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        sent = dict(details.invocation_metadata or ()).get(REQUEST_ID_KEY)
        return _followed(handler, self, details.method.rpartition("/")[2],
                         sent if isinstance(sent, str) else None)

    def begin(self, method: str, sent: str | None, context: grpc.aio.ServicerContext
              ) -> Request:
        """The call's Request; ``InvalidRequest`` for an id that is not one."""
        request = Request(new_request_id() if sent is None else check_request_id(sent), method,
                          tracing=self.tracing)
        context.set_trailing_metadata(((REQUEST_ID_KEY, request.request_id),))
        if self.tracing is not None:
            request.span = self.tracing.start(method, request.request_id)
        return request

    def end(self, request: Request, context: grpc.aio.ServicerContext) -> None:
        code = context.code() if hasattr(context, "code") else None
        name = getattr(code, "name", None) or ("OK" if code in (None, 0) else str(code))
        summary = request.summary(name)
        if request.span is not None and self.tracing is not None:
            self.tracing.finish(request.span, name, request.notes)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rpc %s", _fields(summary))
        ms = summary["ms"]
        if (self.slow_request_s and isinstance(ms, int | float)
                and ms >= self.slow_request_s * 1000):
            log.warning("slow request (over %g s) %s", self.slow_request_s, _fields(summary))


def _fields(summary: dict[str, object]) -> str:
    return " ".join(f"{key}={json.dumps(value) if isinstance(value, dict) else value}"
                    for key, value in summary.items())


def _followed(handler: grpc.RpcMethodHandler, interceptor: RequestInterceptor, name: str,
              sent: str | None) -> grpc.RpcMethodHandler:
    """``handler`` with its Request set while it runs."""
    @contextlib.asynccontextmanager
    async def followed(request: object, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[None]:
        try:
            call = interceptor.begin(name, sent, context)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # abort raised already (its stub does not say it never returns)
        token = _current.set(call)
        try:
            yield
        finally:
            interceptor.end(call, context)  # its lines carry the request's fields
            _current.reset(token)

    return scoped(handler, followed)


class RequestFields(logging.Filter):
    """Adds ``request_id``, ``tenant`` and ``session`` (or None) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = _current.get()
        notes = request.notes if request is not None else {}
        record.request_id = request.request_id if request is not None else None
        record.tenant = notes.get("tenant")
        record.session = notes.get("session")
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the request's fields and,
    for an exception, its traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        for name in ("request_id", "tenant", "session"):
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + \
            f".{int(record.msecs):03d}Z"


def configure_logging(level: str, log_format: str) -> None:
    """The process's root logger: ``level``, lines as ``log_format`` ("text" or "json"),
    each record given its request's fields."""
    if log_format not in LOG_FORMATS:
        raise InvalidRequest(f"log_format {log_format!r} is not one of {list(LOG_FORMATS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RequestFields())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
