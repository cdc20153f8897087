"""The observability files in compose/ against the metrics the code exports (mesh/metric_names.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from infermesh import launcher
from mesh import metric_names

DEPLOY = Path(__file__).resolve().parents[2] / "compose"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "infermesh.json"
METRIC = re.compile(r"\binfermesh_[a-z0-9_]+\b")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_dashboard_is_grafana_dashboard_json(dashboard: dict[str, Any]) -> None:
    assert isinstance(dashboard["title"], str) and dashboard["title"]
    assert isinstance(dashboard["uid"], str) and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 30
    panels = dashboard["panels"]
    assert isinstance(panels, list) and panels
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        assert isinstance(p["type"], str) and p["type"], p
        grid = p["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("x", "y", "w", "h")), p["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, p["title"]
        covered = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                   for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not covered & cells, f"panel {p['title']!r} overlaps another"
        cells |= covered
        if p["type"] == "row":
            continue
        assert p["targets"], f"panel {p['title']!r} has no query"
        for target in p["targets"]:
            assert target["expr"].strip() and target["refId"], p["title"]
            assert target["datasource"]["uid"] == "prometheus"


def test_every_queried_metric_is_exported_and_every_metric_is_on_the_dashboard(dashboard: dict[str, Any]) -> None:
    used = {metric_names.base_name(name) for expr in expressions(dashboard) for name in METRIC.findall(expr)}
    unknown = used - metric_names.names()
    assert not unknown, f"the dashboard queries metrics no service exports: {sorted(unknown)}"
    missing = metric_names.names() - used
    assert not missing, f"metrics without a dashboard panel: {sorted(missing)}"


def test_every_metric_the_code_registers_is_listed_and_typed_as_listed() -> None:
    """The list is the code's: a metric added or renamed in a service must be added or renamed there."""
    import infermesh.supervise  # noqa: F401
    import mesh.telemetry  # noqa: F401
    import services.cache.metrics  # noqa: F401
    import services.edge.metrics  # noqa: F401
    import services.engine.metrics  # noqa: F401
    import services.router.metrics  # noqa: F401
    import services.tokenizer.metrics  # noqa: F401
    from services.cache.block_metrics import BlockStoreCollector

    class Zeros:                            # BlockStore.stats() with every count at 0
        def __getattr__(self, name: str) -> int:
            return 0

    class Store:
        def stats(self) -> Zeros:
            return Zeros()

    blocks = BlockStoreCollector(Store(), "cache-0")  # type: ignore[arg-type]
    registered: dict[str, str] = {}
    for family in [*REGISTRY.collect(), *blocks.collect()]:
        if family.name.startswith("infermesh_"):
            name = family.name + "_total" if family.type == "counter" else family.name
            registered[name] = family.type
    listed = {m.name: m.type for m in metric_names.METRICS}
    assert set(registered) - set(listed) == set(), "registered but not in mesh/metric_names.py"
    assert set(listed) - set(registered) == set(), "listed in mesh/metric_names.py but registered by no service"
    assert registered == listed


def test_prometheus_scrapes_every_service_on_the_launchers_ports() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in config["scrape_configs"]}
    assert set(jobs) == set(metric_names.SERVICES)
    assert jobs["edge"] == [f"127.0.0.1:{launcher.HTTP_PORT}"]
    # Replica 0 on the first port, replica i >= 1 on BASE + i (`infermesh up --routers 3 --tokenizers 3`).
    assert jobs["router"] == [f"127.0.0.1:{p}" for p in (launcher.ROUTER_METRICS_PORT,
                                                          launcher.ROUTER_METRICS_BASE_PORT + 1,
                                                          launcher.ROUTER_METRICS_BASE_PORT + 2)]
    assert jobs["tokenizer"] == [f"127.0.0.1:{p}" for p in (launcher.TOKENIZER_METRICS_PORT,
                                                             launcher.TOKENIZER_METRICS_BASE_PORT + 1,
                                                             launcher.TOKENIZER_METRICS_BASE_PORT + 2)]
    assert jobs["cache"] == [f"127.0.0.1:{launcher.CACHE_METRICS_PORT}"]
    assert jobs["launcher"] == [f"127.0.0.1:{launcher.LAUNCHER_METRICS_PORT}"]
    assert jobs["engine"][0] == f"127.0.0.1:{launcher.ENGINE_METRICS_BASE_PORT}"


def test_grafana_is_provisioned_with_the_dashboard_and_its_data_source() -> None:
    sources = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yml").read_text())
    assert {"prometheus", "jaeger"} <= {s["uid"] for s in sources["datasources"]}
    providers = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "infermesh.yml").read_text())
    stack = yaml.safe_load((DEPLOY / "observability.yml").read_text())
    mounts = stack["services"]["grafana"]["volumes"]
    path = providers["providers"][0]["options"]["path"]
    assert f"./grafana/dashboards:{path}:ro" in mounts


def test_the_collector_sends_traces_to_jaeger() -> None:
    config = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    exporters = pipeline["exporters"]
    assert any(e.endswith("jaeger") for e in exporters)
    jaeger_endpoint = config["exporters"][exporters[0]]["endpoint"]
    stack = yaml.safe_load((DEPLOY / "observability.yml").read_text())
    assert any(jaeger_endpoint in arg for arg in stack["services"]["jaeger"]["command"])
