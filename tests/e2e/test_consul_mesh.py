"""End to end: `infermesh up --discovery consul` against tests/consul_double.py.

No Consul agent can be installed on these machines; the double follows Consul's documented HTTP
API (registration, real gRPC/HTTP health checks, blocking health queries).  Every service
registers itself, the router finds the engine there, and every service deregisters on stop.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from mesh.models import home
from tests.consul_double import ConsulDouble
from tests.e2e.conftest import OFFSET, running_mesh

pytestmark = pytest.mark.e2e


def registered(double: ConsulDouble) -> dict[str, dict[str, object]]:
    with urllib.request.urlopen(f"{double.url}/v1/agent/services", timeout=10) as reply:
        return dict(json.loads(reply.read()))


def all_registered(double: ConsulDouble, expected: set[str], wait_s: float = 10.0) -> dict[str, dict[str, object]]:
    """The registrations once `expected` are all there: the edge announces itself just after its
    /health starts answering (the registry's HTTP check probes it), so it may trail readiness."""
    deadline = time.monotonic() + wait_s
    while set(services := registered(double)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return services


def test_mesh_registers_routes_through_and_deregisters(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The agent presents a mesh certificate to the services' mutual-TLS gRPC checks.
    with ConsulDouble(min_interval_s=0.2, tls_dir=str(home() / "mesh-ca" / "client")) as double:
        env = {"CONSUL_HTTP_ADDR": double.url}
        with running_mesh(["--engines", "1", "--discovery", "consul", "--kv-cache-mb", "64"], OFFSET + 200,
                          tmp_path / "up.log", env=env) as mesh:
            expected = {"cache-0", "tokenizer-0", "engine-0", "router-0", "edge-0"}
            services = all_registered(double, expected)
            assert set(services) == expected
            engine = services["engine-0"]
            assert engine["Service"] == "engine" and engine["Port"] == 50060 + OFFSET + 200
            assert engine["Meta"]["model"] == "smollm2-135m" and engine["Meta"]["model_version"] == "1"  # type: ignore[index]
            assert all(c.status == "passing" for c in double.checks_of("engine-0"))
            assert double.checks_of("edge-0")[0].kind == "http"
            body = json.dumps({"model": "smollm2-135m", "max_tokens": 4, "temperature": 0,
                               "messages": [{"role": "user", "content": "Hi"}]}).encode()
            req = urllib.request.Request(f"{mesh.http}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as reply:
                answer = json.loads(reply.read())
            assert answer["infermesh"]["replica"] == "engine-0"
        assert registered(double) == {}
