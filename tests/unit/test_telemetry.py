"""Tracing is configured from OTEL_* variables and the trace context crosses a gRPC hop."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mesh import telemetry
from mesh.grpcutil import channel


def test_unknown_exporter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin-ish")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        telemetry.setup_tracing("test")


def test_trace_context_crosses_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    monkeypatch.setattr(telemetry, "_tracer", tracer)
    seen: list[trace.SpanContext] = []

    class Probe(health_pb2_grpc.HealthServicer):
        async def Check(self, request, context):  # type: ignore[no-untyped-def]
            with telemetry.server_span("probe", context) as span:
                seen.append(span.get_span_context())
                seen.append(span.parent)  # type: ignore[attr-defined]
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def scenario() -> int:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(Probe(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            with tracer.start_as_current_span("client") as client_span:
                async with channel(f"127.0.0.1:{port}") as ch:
                    await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                              metadata=telemetry.outgoing_metadata())
                return client_span.get_span_context().trace_id
        finally:
            await server.stop(0)

    trace_id = asyncio.run(scenario())
    server_ctx, parent = seen
    assert server_ctx.trace_id == trace_id
    assert parent is not None and parent.trace_id == trace_id
    assert {s.name for s in exporter.get_finished_spans()} == {"probe", "client"}
