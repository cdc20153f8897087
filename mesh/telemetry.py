"""OpenTelemetry setup shared by every service, driven only by the standard OTEL_* variables.

- OTEL_TRACES_EXPORTER: `otlp`, `console` or `none` (default: `otlp` when
  OTEL_EXPORTER_OTLP_ENDPOINT is set, else `none`, so a laptop run logs no export errors).
- OTEL_EXPORTER_OTLP_ENDPOINT and the other OTLP variables are read by the exporter itself.
- OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES) name the service; the default is
  `infermesh-<service>`.

Trace context crosses every gRPC hop as W3C `traceparent` metadata: clients call
`outgoing_metadata()`, servers open their span with `server_span(name, context)`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

_tracer: trace.Tracer = trace.get_tracer("infermesh")


def setup_tracing(service: str) -> trace.Tracer:
    """Install the global tracer provider for this process and return its tracer."""
    global _tracer
    attrs: dict[str, Any] = {}
    if "OTEL_SERVICE_NAME" not in os.environ:
        attrs["service.name"] = f"infermesh-{service}"
    provider = TracerProvider(resource=Resource.create(attrs))
    default = "otlp" if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else "none"
    for name in os.environ.get("OTEL_TRACES_EXPORTER", default).split(","):
        name = name.strip().lower()
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            # Imported only when asked for: the exporter pulls in a second gRPC stack.
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name not in ("none", ""):
            raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported (use otlp, console or none)")
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("infermesh")
    return _tracer


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def tracer() -> trace.Tracer:
    return _tracer


def outgoing_metadata(extra: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current trace context to the next hop."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) + extra


def headers_context(headers: dict[str, str]) -> Any:
    """The trace context named by W3C headers (`traceparent`, `tracestate`)."""
    return propagate.extract(headers)


@contextmanager
def server_span(name: str, grpc_context: Any = None, **attributes: Any) -> Iterator[trace.Span]:
    """A server span whose parent is the caller's, read from gRPC invocation metadata."""
    parent = None
    if grpc_context is not None:
        metadata = grpc_context.invocation_metadata() or ()
        parent = propagate.extract({k: v for k, v in metadata if isinstance(v, str)})
    with _tracer.start_as_current_span(
        name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span
