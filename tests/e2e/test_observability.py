"""End to end: one trace across every hop, every listed metric on every service, `infermesh top`.

The mesh runs with OTEL_TRACES_EXPORTER=console: each service writes its spans to stdout, one JSON
object per line, and the launcher relays them into the log with the service's prefix.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infermesh import top
from mesh import metric_names
from tests.e2e.conftest import OFFSET, Mesh, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 600
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
# The service of each span name: edge, router, tokenizer, engine and cache all take part in one chat request.
EXPECTED = {
    "edge.request": "edge", "router.generate": "router", "router.session_lookup": "router",
    "router.tokenize": "router", "router.attempt": "router", "tokenizer.apply_chat_template": "tokenizer",
    "engine.generate": "engine", "engine.queue": "engine", "engine.prefill": "engine", "engine.decode": "engine",
    "cache.get_session": "cache",
}
METRICS_PORTS = {"router": 9180, "tokenizer": 9181, "cache": 9182, "engine": 9100, "launcher": 9183}


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("observability") / "infermesh-up.log"
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with running_mesh(["--engines", "1", "--kv-cache-mb", "64"], PORTS, log, env=env) as m:
        yield m


def chat(mesh: Mesh, headers: dict[str, str]) -> dict[str, Any]:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(f"{mesh.http}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=300) as reply:
        return dict(json.loads(reply.read()))


def spans_in(log: Path, trace_id: str) -> dict[str, dict[str, Any]]:
    """name -> the console exporter's JSON of the trace's spans, read from the launcher's log."""
    found: dict[str, dict[str, Any]] = {}
    for line in log.read_text(errors="replace").splitlines():
        prefix, _, rest = line.partition("] ")
        if not prefix.startswith("[") or not rest.startswith("{"):
            continue
        try:
            span = json.loads(rest)
        except json.JSONDecodeError:
            continue
        if isinstance(span, dict) and span.get("context", {}).get("trace_id") == f"0x{trace_id}":
            span["_child"] = prefix[1:]
            found[span["name"]] = span
    return found


def test_one_trace_id_crosses_edge_router_tokenizer_engine_and_cache(traced: Mesh) -> None:
    reply = chat(traced, {"traceparent": TRACEPARENT, "x-session-id": "observability-trace"})
    assert reply["choices"][0]["message"]["content"]
    deadline = time.monotonic() + 60
    spans = spans_in(traced.log, TRACE_ID)
    while set(EXPECTED) - set(spans) and time.monotonic() < deadline:
        time.sleep(0.5)
        spans = spans_in(traced.log, TRACE_ID)
    missing = set(EXPECTED) - set(spans)
    assert not missing, f"spans missing from trace {TRACE_ID}: {sorted(missing)}; got {sorted(spans)}"
    for name, service in EXPECTED.items():
        assert spans[name]["resource"]["attributes"]["service.name"] == f"infermesh-{service}", name
        assert spans[name]["_child"].startswith(service), name

    def parent_of(name: str) -> str:
        return str(spans[name]["parent_id"])

    def span_id(name: str) -> str:
        return str(spans[name]["context"]["span_id"])

    # The client's span is the edge's parent; every hop hangs below the span that called it.
    assert parent_of("edge.request") == f"0x{CLIENT_SPAN}"
    assert parent_of("router.generate") == span_id("edge.request")
    assert parent_of("router.tokenize") == span_id("router.generate")
    assert parent_of("tokenizer.apply_chat_template") == span_id("router.tokenize")
    assert parent_of("router.session_lookup") == span_id("router.generate")
    assert parent_of("cache.get_session") == span_id("router.session_lookup")
    assert parent_of("router.attempt") == span_id("router.generate")
    assert parent_of("engine.generate") == span_id("router.attempt")
    for phase in ("engine.queue", "engine.prefill", "engine.decode"):
        assert parent_of(phase) == span_id("engine.generate")
    # The phases follow each other: queue, then prefill, then decode.
    assert spans["engine.queue"]["end_time"] == spans["engine.prefill"]["start_time"]
    assert spans["engine.prefill"]["end_time"] == spans["engine.decode"]["start_time"]
    served = reply["infermesh"]
    decision = spans["router.generate"]["attributes"]
    assert decision["replica"] == served["replica"] == spans["router.attempt"]["attributes"]["replica"]
    assert decision["model_version"] == served["model_version"]
    assert decision["policy"] and decision["reason"]
    assert decision["degraded"] is False and decision["failover_attempts"] == 0
    assert spans["engine.generate"]["attributes"]["finish_reason"] in ("stop", "length")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return str(reply.read().decode())


def declared(text: str) -> set[str]:
    """Metric names with a `# TYPE` line (present even before their first sample); counters get `_total`."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    return names


def test_every_service_exports_every_listed_metric(traced: Mesh) -> None:
    chat(traced, {"x-session-id": "observability-metrics"})        # so most series have samples
    endpoints = {"edge": f"{traced.http}/metrics",
                 **{s: f"http://127.0.0.1:{port + PORTS}/metrics" for s, port in METRICS_PORTS.items()}}
    assert set(endpoints) == set(metric_names.SERVICES)
    for service, url in endpoints.items():
        text = scrape(url)
        listed = {m.name for m in metric_names.of_service(service)}
        missing = listed - declared(text)
        assert not missing, f"{service} ({url}) does not export {sorted(missing)}"
        unlisted = {name for name in with_samples(text) if name.startswith("infermesh_")} - listed
        assert not unlisted, f"{service} exports metrics missing from mesh/metric_names.py: {sorted(unlisted)}"
    router = samples(scrape(endpoints["router"]))
    assert router[("infermesh_router_replica_up", (("model", "smollm2-135m"), ("model_version", "1"),
                                                   ("region", "local"), ("replica", "engine-0")))] == 1
    assert router[("infermesh_router_breaker_state", (("replica", "engine-0"),))] == 0
    # Both requests so far finished on the engine (its counters move as each stream closes: poll a moment).
    ok = (("code", "OK"), ("method", "engine.generate"), ("service", "engine"))
    deadline = time.monotonic() + 10
    while True:
        engine = samples(scrape(endpoints["engine"]))
        finished = sum(v for (name, labels), v in engine.items() if name == "infermesh_engine_requests_total"
                       and dict(labels)["finish_reason"] in ("stop", "length"))
        if (engine.get(("infermesh_grpc_server_requests_total", ok), 0) >= 2 and finished >= 2) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert engine[("infermesh_grpc_server_requests_total", ok)] >= 2
    assert finished >= 2


def with_samples(text: str) -> set[str]:
    """Metric names with at least one sample (counters with `_total`; `_created` series left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name + "_total" if f.type == "counter" else f.name
            for f in text_string_to_metric_families(text) if f.samples and not f.name.endswith("_created")}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_infermesh_top_once_shows_the_replicas(traced: Mesh) -> None:
    out = subprocess.run([sys.executable, "-m", "infermesh.cli", "top", "--once", "--router", traced.router],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"infermesh top - router {traced.router}") and "1/1 replicas up" in lines[0]
    header = lines[2].split()
    assert header[:6] == ["REPLICA", "MODEL", "VER", "REGION", "STATE", "BREAKER"]
    row = lines[3].split()
    assert row[0] == "engine-0" and row[2] == "1" and row[3] == "local" and row[4] == "up" and row[5] == "closed"
    assert "\x1b[" not in out.stdout                        # not a terminal: no colour, no clear


def test_top_renders_a_snapshot_without_a_mesh() -> None:
    snap = top.TopSnapshot("127.0.0.1:50051", [
        top.Row("engine-1", "m", "2", "eu", "isolated", "open", 0, 0, 0, -1.0, 0.0, 0.0),
        top.Row("engine-0", "m", "1", "eu", "up", "closed", 3, 2, 1, 0.5, 41.5, 120.0),
    ], 0.75)
    text = top.render(snap, now=0)
    lines = text.splitlines()
    assert "1/2 replicas up" in lines[0] and "load entropy 0.75" in lines[0]
    assert lines[3].split() == ["engine-0", "m", "1", "eu", "up", "closed", "3", "2", "1", "50", "41.5", "120"]
    assert lines[4].split() == ["engine-1", "m", "2", "eu", "isolated", "open", "0", "0", "0", "-", "0.0", "0"]
    coloured = top.render(snap, color=True, now=0)
    assert "\x1b[31misolated\x1b[0m" in coloured and "\x1b[32mclosed\x1b[0m" in coloured
