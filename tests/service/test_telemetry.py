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


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("test"))
    return exporter


def test_the_console_exporter_writes_one_json_span_per_line(spans: InMemorySpanExporter) -> None:
    import io
    import json

    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    with telemetry.tracer().start_as_current_span("outer"), telemetry.tracer().start_as_current_span("inner"):
        pass
    out = io.StringIO()
    ConsoleSpanExporter(out=out, formatter=telemetry._one_line).export(spans.get_finished_spans())
    lines = out.getvalue().splitlines()
    assert [json.loads(line)["name"] for line in lines] == ["inner", "outer"]


def test_span_between_makes_a_child_over_the_given_times(spans: InMemorySpanExporter) -> None:
    with telemetry.tracer().start_as_current_span("engine.generate") as parent:
        telemetry.span_between("engine.queue", 1_000, 5_000, parent, waited=True)
        telemetry.span_between("engine.decode", 0, 9_000, parent)          # never started: no span
        telemetry.span_between("engine.prefill", 7_000, 6_000, parent)     # ends before it starts: none
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) == {"engine.generate", "engine.queue"}
    queue = by_name["engine.queue"]
    assert (queue.start_time, queue.end_time) == (1_000, 5_000)
    assert queue.parent is not None and queue.parent.span_id == parent.get_span_context().span_id
    assert queue.context.trace_id == parent.get_span_context().trace_id
    assert queue.attributes is not None and queue.attributes["waited"] is True


def test_outgoing_metadata_can_carry_a_span_that_is_not_current(spans: InMemorySpanExporter) -> None:
    span = telemetry.tracer().start_span("router.attempt")
    metadata = dict(telemetry.outgoing_metadata(context=telemetry.span_context(span)))
    ctx = span.get_span_context()
    assert metadata["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
    assert "traceparent" not in dict(telemetry.outgoing_metadata())    # nothing current here
    span.end()


class _Context:
    """The parts of grpc.aio.ServicerContext that server_span reads."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), code: grpc.StatusCode | None = None):
        self.metadata, self._code = metadata, code

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def code(self) -> grpc.StatusCode | None:
        return self._code


def _count(method: str, code: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value("infermesh_grpc_server_requests_total",
                                      {"service": telemetry._service, "method": method, "code": code})
    return value or 0.0


def test_server_span_counts_each_rpc_by_its_status_code(spans: InMemorySpanExporter) -> None:
    from mesh.errors import NotFound

    method = "test.count"
    before = {code: _count(method, code) for code in ("OK", "NOT_FOUND", "CANCELLED", "INTERNAL", "UNAVAILABLE")}
    with telemetry.server_span(method, _Context()):
        pass
    with pytest.raises(NotFound), telemetry.server_span(method, _Context()):
        raise NotFound("no such model")
    with pytest.raises(asyncio.CancelledError), telemetry.server_span(method, _Context()):
        raise asyncio.CancelledError
    with pytest.raises(KeyError), telemetry.server_span(method, _Context()):
        raise KeyError("bug")
    with pytest.raises(grpc.aio.AbortError), telemetry.server_span(method, _Context(code=grpc.StatusCode.UNAVAILABLE)):
        raise grpc.aio.AbortError
    after = {code: _count(method, code) for code in before}
    assert {code: after[code] - before[code] for code in before} == {
        "OK": 1, "NOT_FOUND": 1, "CANCELLED": 1, "INTERNAL": 1, "UNAVAILABLE": 1}
    statuses = [(s.attributes or {}).get("rpc.grpc.status_code") for s in spans.get_finished_spans()]
    assert statuses == ["OK", "NOT_FOUND", "CANCELLED", "INTERNAL", "UNAVAILABLE"]
    errors = [s.status.is_ok for s in spans.get_finished_spans()]
    assert errors == [True, False, True, False, False]


def test_the_server_span_continues_the_callers_trace(spans: InMemorySpanExporter) -> None:
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with telemetry.server_span("test.parent", _Context((("traceparent", parent),))) as span:
        ctx = span.get_span_context()
    assert f"{ctx.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span.parent is not None and f"{span.parent.span_id:016x}" == "00f067aa0ba902b7"  # type: ignore[attr-defined]


def test_the_routers_replica_gauges_are_read_at_scrape_time() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from services.router import metrics

    collector = metrics.ReplicaCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    assert b"infermesh_router_breaker_state" in generate_latest(registry)      # declared before any router
    collector.source = lambda now: metrics.Snapshot(
        [metrics.ReplicaSample("engine-0", "m", "2", "eu", True, 3, 1, 0.25),
         metrics.ReplicaSample("engine-1", "m", "2", "us", False, 0, 0, 0.0)],
        {"engine-1": "open"}, {"m": "half_open"})
    value = registry.get_sample_value
    assert value("infermesh_router_replica_up", {"replica": "engine-0", "model": "m", "model_version": "2",
                                                 "region": "eu"}) == 1
    assert value("infermesh_router_replica_up", {"replica": "engine-1", "model": "m", "model_version": "2",
                                                 "region": "us"}) == 0
    assert value("infermesh_router_replica_running", {"replica": "engine-0"}) == 3
    assert value("infermesh_router_replica_waiting", {"replica": "engine-0"}) == 1
    assert value("infermesh_router_replica_kv_used_ratio", {"replica": "engine-0"}) == 0.25
    assert value("infermesh_router_breaker_state", {"replica": "engine-0"}) == 0
    assert value("infermesh_router_breaker_state", {"replica": "engine-1"}) == 2
    assert value("infermesh_router_model_breaker_state", {"model": "m"}) == 1
