"""OpenTelemetry spans of the calls an operator follows (Spill, Restore, Resume) and of
their phases, the replay among them, exported over OTLP/gRPC to ``otlp_endpoint``.

The OpenTelemetry SDK (the ``tracing`` extra) does the work: a ``TracerProvider`` of this
server alone (never the process-global one, so two servers in a process and the tests
keep theirs apart) with a batching processor and the OTLP exporter. A call's span
carries ``kvtier.request_id`` and what the call noted (tenant, session, tier, bytes,
replay tokens: ``services.server.requests``); each phase is a child span. Without an
endpoint nothing is imported and nothing traced.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvstore.format.errors import InvalidRequest

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import Span

TRACED = frozenset({"Spill", "Restore", "Resume"})
ATTRIBUTE_PREFIX = "kvtier."


class Tracing:
    """Spans of one server, through ``processor`` (default: batches to ``endpoint``)."""

    def __init__(self, endpoint: str = "", node: str = "", *,
                 processor: SpanProcessor | None = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise InvalidRequest("otlp_endpoint is set but the OpenTelemetry SDK is not "
                                 "installed: pip install 'kvtier[tracing]'") from None
        if processor is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # an http:// endpoint is plaintext, https:// TLS (the exporter reads the scheme)
            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        attributes = {"service.name": "kvtier"}
        if node:
            attributes["service.instance.id"] = node
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvtier")

    def start(self, method: str, request_id: str) -> Span | None:
        """The span of a call of ``method`` (None for the methods not traced)."""
        if method not in TRACED:
            return None
        return self.tracer.start_span(f"kvtier.{method}",
                                      attributes={"kvtier.request_id": request_id})

    def phase(self, parent: Span, name: str, seconds: float) -> None:
        """A child span of ``parent`` for a phase that ended now and took ``seconds``."""
        from opentelemetry.trace import set_span_in_context

        end = time.time_ns()
        child = self.tracer.start_span(name, context=set_span_in_context(parent),
                                       start_time=end - int(seconds * 1e9))
        child.end(end_time=end)

    @staticmethod
    def finish(span: Span, code: str, notes: dict[str, object]) -> None:
        from opentelemetry.trace import Status, StatusCode

        for key, value in notes.items():
            if isinstance(value, str | int | float | bool):
                span.set_attribute(ATTRIBUTE_PREFIX + key, value)
        span.set_attribute("rpc.grpc.status_code", code)
        if code != "OK":
            span.set_status(Status(StatusCode.ERROR, code))
        span.end()

    def close(self) -> None:
        """Export what is batched, then stop."""
        self.provider.shutdown()


def tracing_for(config) -> Tracing | None:
    return Tracing(config.otlp_endpoint, config.node_id) if config.otlp_endpoint else None
