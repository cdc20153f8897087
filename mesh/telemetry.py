"""OpenTelemetry and Prometheus setup shared by every service, driven only by the standard OTEL_* variables.

- OTEL_TRACES_EXPORTER: `otlp`, `console` or `none`, comma-separated for several (default: `otlp` when
  OTEL_EXPORTER_OTLP_ENDPOINT is set, else `none`, so a laptop run logs no export errors).  `console`
  writes one span per line, as compact JSON, to stdout: `infermesh up` relays it with the service's prefix.
- OTEL_EXPORTER_OTLP_ENDPOINT and the other OTLP variables are read by the exporter itself;
  OTEL_BSP_SCHEDULE_DELAY and the other batch-processor variables by the SDK.
- OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES) name the service; the default is
  `infermesh-<service>`.

Trace context crosses every gRPC hop as W3C `traceparent` metadata: clients call
`outgoing_metadata()` (inside a `client_span`), servers open their span with `server_span(name, context)`,
which also counts the RPC in `infermesh_grpc_server_requests_total{service, method, code}`.
Prometheus metrics are served by `serve_metrics(port)`; their names are listed in mesh/metric_names.py.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import Status, StatusCode
from prometheus_client import Counter, Histogram

from mesh.errors import MeshError

_tracer: trace.Tracer = trace.get_tracer("infermesh")
_service = "unknown"

RPCS = Counter("infermesh_grpc_server_requests_total", "gRPC requests served, by method and status code",
               ["service", "method", "code"])
RPC_SECONDS = Histogram("infermesh_grpc_server_duration_seconds",
                        "gRPC request duration (a streaming call: until its last message)", ["service", "method"],
                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))


def _one_line(span: ReadableSpan) -> str:
    # One span per line: a log relayed line by line (the launcher prefixes each) stays parseable.
    return span.to_json(indent=None) + os.linesep


def setup_tracing(service: str) -> trace.Tracer:
    """Install the global tracer provider for this process and return its tracer."""
    global _tracer, _service
    _service = service
    attrs: dict[str, Any] = {}
    if "OTEL_SERVICE_NAME" not in os.environ:
        attrs["service.name"] = f"infermesh-{service}"
    provider = TracerProvider(resource=Resource.create(attrs))
    default = "otlp" if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else "none"
    for name in os.environ.get("OTEL_TRACES_EXPORTER", default).split(","):
        name = name.strip().lower()
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(formatter=_one_line)))
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


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Prometheus /metrics on http://host:port (a daemon thread); port 0: off."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host)


def outgoing_metadata(extra: tuple[tuple[str, str], ...] = (), context: Any = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the trace context (the current one, or `context`) to the next hop."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return tuple(carrier.items()) + extra


def headers_context(headers: dict[str, str]) -> Any:
    """The trace context named by W3C headers (`traceparent`, `tracestate`)."""
    return propagate.extract(headers)


def span_context(span: trace.Span) -> Any:
    """A context whose current span is `span`, for `outgoing_metadata(context=...)` and child spans,
    without making it current: spans held across an async generator's yields must not be attached
    to the task's context (another task may end the generator and could not detach them)."""
    return trace.set_span_in_context(span)


@contextmanager
def client_span(name: str, **attributes: Any) -> Iterator[trace.Span]:
    """A client span, current inside the block: `outgoing_metadata()` there makes it the callee's parent."""
    with _tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT, attributes=attributes) as span:
        yield span


def span_between(name: str, start_ns: int, end_ns: int, parent: trace.Span, **attributes: Any) -> None:
    """A finished child span of `parent` over [start_ns, end_ns] (time.time_ns() readings): for phases
    measured by the code that ran them (an engine request's queue wait, prefill, decode)."""
    if not start_ns or end_ns < start_ns:
        return
    span = _tracer.start_span(name, context=span_context(parent), attributes=attributes, start_time=start_ns)
    span.end(end_time=end_ns)


def status_code(exc: BaseException | None, grpc_context: Any = None) -> str:
    """The gRPC status an RPC handler ends with, as a metrics label: OK, CANCELLED, NOT_FOUND, ..."""
    if exc is None:
        return "OK"
    if isinstance(exc, MeshError):
        return exc.code.name
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    if isinstance(exc, grpc.aio.AbortError) and grpc_context is not None:
        try:
            code = grpc_context.code()
        except Exception:       # not every context (or test double) knows its code
            code = None
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return "INTERNAL"


@contextmanager
def server_span(name: str, grpc_context: Any = None, **attributes: Any) -> Iterator[trace.Span]:
    """A server span whose parent is the caller's, read from gRPC invocation metadata; the RPC is
    counted by status code and timed under method=`name`."""
    parent = None
    if grpc_context is not None:
        metadata = grpc_context.invocation_metadata() or ()
        parent = propagate.extract({k: v for k, v in metadata if isinstance(v, str)})
    started = time.perf_counter()
    error: BaseException | None = None
    span = _tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
    # Current in the block, for the handler's client spans.  A streaming handler holds it across its
    # yields, and a cancelled call's generator is closed later by the loop from another task, whose
    # context never held it: only the task that attached detaches (else OpenTelemetry logs a
    # "Failed to detach context" traceback; the other task's context is discarded anyway).
    owner = _current_task()
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    try:
        yield span
    except BaseException as exc:
        error = exc
        raise
    finally:
        code = status_code(error, grpc_context)
        span.set_attribute("rpc.grpc.status_code", code)
        if code not in ("OK", "CANCELLED"):
            span.set_status(Status(StatusCode.ERROR, f"{code}: {error}"))
        span.end()
        if _current_task() is owner:
            otel_context.detach(token)
        RPCS.labels(_service, name, code).inc()
        RPC_SECONDS.labels(_service, name).observe(time.perf_counter() - started)


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:            # no running loop: plain threads, one context each
        return None
