"""ConsulDiscovery against tests/consul_double.py (Consul's documented HTTP API; no agent runs here),
with real gRPC health servers as the engines the double's checks probe."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import consul
import pytest
import requests

from mesh.discovery import DiscoveryError, Endpoint, HealthCheck
from mesh.discovery.consul import ConsulDiscovery
from mesh.grpcutil import Service
from tests.consul_double import ConsulDouble

FAST = {"interval_s": 0.2, "timeout_s": 1.0}


def _double(reap_min_s: float = 60.0) -> ConsulDouble:
    return ConsulDouble(min_interval_s=0.2, reap_min_s=reap_min_s)   # Consul's floor is 1s; tests run faster


def _discovery(double: ConsulDouble, wait_s: float = 2.0) -> ConsulDiscovery:
    return ConsulDiscovery(double.host, double.port, wait_s=wait_s, rng=lambda: 0.0)


@asynccontextmanager
async def _engines(n: int) -> AsyncIterator[list[Service]]:
    services = [Service("meshpb.v1.Engine", "127.0.0.1", 0) for _ in range(n)]
    for s in services:
        await s.start()
        await s.ready()
    try:
        yield services
    finally:
        await asyncio.gather(*(s.stop(0) for s in services))


def _endpoint(i: int, service: Service) -> Endpoint:
    return Endpoint("engine", f"engine-{i}", f"127.0.0.1:{service.port}", "smollm2", str(i + 1), "eu",
                    (("device", "cpu"),))


class _Follower:
    """Collects what `watch` yields, so tests can wait for a list that satisfies a condition."""

    def __init__(self, discovery: ConsulDiscovery, service: str):
        self.seen: list[list[Endpoint]] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run(discovery, service))

    async def _run(self, discovery: ConsulDiscovery, service: str) -> None:
        async for endpoints in discovery.watch(service):
            self.seen.append(endpoints)
            self._changed.set()

    async def until(self, want: Callable[[list[Endpoint]], bool], timeout: float = 15.0) -> list[Endpoint]:
        deadline = time.monotonic() + timeout
        while not (self.seen and want(self.seen[-1])):
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))
        return self.seen[-1]

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _ids(endpoints: Sequence[Endpoint]) -> list[str]:
    return [e.replica_id for e in endpoints]


def test_engines_register_appear_fail_and_deregister() -> None:
    async def scenario() -> None:
        with _double() as double:
            discovery = _discovery(double)
            async with _engines(2) as (a, b):
                assert await discovery.leader() == "127.0.0.1:8300"
                # engine-1's check names the gRPC service (GRPC "host:port/service"), engine-0's the server.
                for i, (svc, name) in enumerate(((a, ""), (b, "/meshpb.v1.Engine"))):
                    await discovery.register(_endpoint(i, svc),
                                             HealthCheck.grpc(f"127.0.0.1:{svc.port}{name}", **FAST))
                follower = _Follower(discovery, "engine")
                try:
                    # Registered checks start critical: nothing passes until the double has run them.
                    both = await follower.until(lambda eps: _ids(eps) == ["engine-0", "engine-1"])
                    assert both[1] == Endpoint("engine", "engine-1", f"127.0.0.1:{b.port}", "smollm2", "2", "eu",
                                               (("device", "cpu"),),
                                               ("infermesh", "region=eu", "model=smollm2", "version=2"))
                    assert discovery.endpoints("engine") == both
                    statuses = {c.status for c in double.checks_of("engine-0") + double.checks_of("engine-1")}
                    assert statuses == {"passing"}

                    await b.ready(False)                      # NOT_SERVING: the check goes critical
                    assert _ids(await follower.until(lambda eps: len(eps) == 1)) == ["engine-0"]
                    assert double.checks_of("engine-1")[0].status == "critical"
                    assert "NOT_SERVING" in double.checks_of("engine-1")[0].output

                    await b.ready(True)
                    await follower.until(lambda eps: len(eps) == 2)

                    await discovery.deregister("engine-0")
                    assert _ids(await follower.until(lambda eps: len(eps) == 1)) == ["engine-1"]
                    agent = consul.Consul(host=double.host, port=double.port)
                    assert set(agent.agent.services()) == {"engine-1"}
                    await discovery.deregister("engine-1")
                    assert await follower.until(lambda eps: eps == []) == []
                    await discovery.deregister("engine-1")     # unknown by now (agent: 404): no raise
                finally:
                    await follower.stop()
                    await discovery.close()

    asyncio.run(scenario())


def test_blocking_query_returns_on_change_or_after_wait() -> None:
    with _double() as double:
        agent = consul.Consul(host=double.host, port=double.port)
        agent.agent.service.register("engine", service_id="engine-0", address="127.0.0.1", port=1,
                                     check={"TTL": "30s", "Status": "passing"})
        index, entries = agent.health.service("engine", passing=True)
        assert [e["Service"]["ID"] for e in entries] == ["engine-0"]
        # A check registered without Status starts critical, so the new instance is not passing.
        agent.agent.service.register("engine", service_id="engine-1", address="127.0.0.1", port=2,
                                     check={"TTL": "30s"})
        assert double.checks_of("engine-1")[0].status == "critical"
        index, entries = agent.health.service("engine", passing=True)
        assert [e["Service"]["ID"] for e in entries] == ["engine-0"]
        # Re-registering keeps the check's status (the agent restores it), so nothing flaps.
        agent.agent.service.register("engine", service_id="engine-0", address="127.0.0.1", port=1,
                                     check={"TTL": "30s"})
        assert double.checks_of("engine-0")[0].status == "passing"
        index, _ = agent.health.service("engine", passing=True)

        start = time.monotonic()
        same, _ = agent.health.service("engine", passing=True, index=index, wait="1s")
        waited = time.monotonic() - start
        assert same == index and 1.0 <= waited < 4.0   # wait, plus at most wait/16 of jitter (and a busy CI)

        threading.Timer(0.3, double.set_check_status, args=("service:engine-0", "critical")).start()
        start = time.monotonic()
        changed, entries = agent.health.service("engine", passing=True, index=index, wait="10s")
        took = time.monotonic() - start
        assert 0.25 <= took < 5.0 and int(changed) > int(index) and entries == []
        # Without `passing` the critical instance is still listed, with its check's status.
        _, every = agent.health.service("engine")
        assert [c["Status"] for c in every[0]["Checks"]] == ["passing", "critical"]


def test_watch_blocks_instead_of_polling() -> None:
    async def scenario() -> None:
        with _double() as double:
            discovery = _discovery(double, wait_s=30.0)
            async with _engines(1) as (engine,):
                await discovery.register(_endpoint(0, engine), HealthCheck.grpc(f"127.0.0.1:{engine.port}", **FAST))
                follower = _Follower(discovery, "engine")
                try:
                    await follower.until(lambda eps: len(eps) == 1)
                    before = double.health_queries
                    await asyncio.sleep(1.0)      # the check keeps passing (5 runs): no catalog change
                    # One query is held by the agent; a polling client would have sent ~10 (0.1s floor).
                    assert double.health_queries - before <= 1
                finally:
                    await follower.stop()

    asyncio.run(scenario())


def test_watch_survives_the_agent_restarting(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mesh.discovery.consul")

    async def scenario() -> None:
        with _double() as double:
            discovery = _discovery(double)
            async with _engines(1) as (engine,):
                await discovery.register(_endpoint(0, engine), HealthCheck.grpc(f"127.0.0.1:{engine.port}", **FAST))
                follower = _Follower(discovery, "engine")
                try:
                    await follower.until(lambda eps: len(eps) == 1)
                    yielded = len(follower.seen)
                    double.stop()
                    await asyncio.sleep(2.0)                     # a few failed queries with backoff
                    assert len(follower.seen) == yielded         # the outage yields nothing...
                    assert _ids(discovery.endpoints("engine")) == ["engine-0"]   # ...and keeps the last list
                    outage = [r for r in caplog.records if "not answering" in r.getMessage()]
                    assert len(outage) == 1                      # logged once per outage, not per retry
                    double.start()                               # same port, services restored
                    deadline = time.monotonic() + 15
                    while not any("answers again" in r.getMessage() for r in caplog.records):
                        assert time.monotonic() < deadline, "the watcher did not reconnect"
                        await asyncio.sleep(0.1)
                    # The restored check may have passed again before the first answer (then the list is
                    # unchanged and nothing is yielded); either way the watch follows changes again.
                    await engine.ready(False)
                    assert await follower.until(lambda eps: eps == []) == []
                    await engine.ready(True)
                    assert _ids(await follower.until(lambda eps: len(eps) == 1)) == ["engine-0"]
                finally:
                    await follower.stop()

    asyncio.run(scenario())


def test_watch_recovers_when_the_index_goes_backwards() -> None:
    async def scenario() -> None:
        with _double() as double:
            discovery = _discovery(double, wait_s=1.0)
            async with _engines(1) as (engine,):
                await discovery.register(_endpoint(0, engine), HealthCheck.grpc(f"127.0.0.1:{engine.port}", **FAST))
                follower = _Follower(discovery, "engine")
                try:
                    await follower.until(lambda eps: len(eps) == 1)
                    deadline = time.monotonic() + 10    # the watcher's next query, blocking on the index it got
                    while double.query_indexes[-1] <= 2:
                        assert time.monotonic() < deadline, double.query_indexes
                        await asyncio.sleep(0.05)
                    asked = len(double.query_indexes)
                    double.rewind_index(2)
                    # The held query times out answering index 2 < `held`: the watcher resets to 0 (a query
                    # that answers at once), then blocks on the new, low index instead of on `held`, which
                    # would hold every query for the whole wait from now on.
                    deadline = time.monotonic() + 10
                    while not (0 in double.query_indexes[asked:] and double.query_indexes[-1] == 2):
                        assert time.monotonic() < deadline, double.query_indexes
                        await asyncio.sleep(0.05)
                    await engine.ready(False)
                    assert await follower.until(lambda eps: eps == [], timeout=5.0) == []
                finally:
                    await follower.stop()

    asyncio.run(scenario())


def test_http_check_for_the_edge_and_critical_services_are_reaped() -> None:
    async def scenario() -> None:
        with _double(reap_min_s=0.0) as double:
            discovery = _discovery(double)
            # The double's own /v1/status/leader answers 200; a 404 URL is critical.
            await discovery.register(Endpoint("edge", "edge-0", double.address),
                                     HealthCheck.http(f"{double.url}/v1/status/leader", **FAST))
            await discovery.register(Endpoint("edge", "edge-1", double.address),
                                     HealthCheck.http(f"{double.url}/nowhere", deregister_after_s=0.5, **FAST))
            follower = _Follower(discovery, "edge")
            try:
                assert _ids(await follower.until(lambda eps: len(eps) == 1)) == ["edge-0"]
                agent = consul.Consul(host=double.host, port=double.port)
                deadline = time.monotonic() + 10
                while "edge-1" in agent.agent.services() and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert set(agent.agent.services()) == {"edge-0"}
            finally:
                await follower.stop()

    asyncio.run(scenario())


def test_malformed_registrations_get_400_with_a_message() -> None:
    with _double() as double:
        url = f"{double.url}/v1/agent/service/register"
        bodies: list[tuple[dict[str, Any], str]] = [
            ({"ID": "x"}, "Missing service name"),
            ({"Name": "engine", "Port": "50060"}, "decode"),
            ({"Name": "engine", "Meta": {"bad key": "v"}}, "Invalid Service Meta"),
            ({"Name": "engine", "Check": {"GRPC": "127.0.0.1:1"}}, "Interval must be > 0"),
            ({"Name": "engine", "Check": {"GRPC": "127.0.0.1:1", "Interval": "2 seconds"}}, "invalid duration"),
            ({"Name": "engine", "Check": {"TTL": "5s", "Status": "fine"}}, "Status for checks"),
            ({"Name": "engine", "Check": {"Args": ["/bin/true"], "Interval": "1s"}}, "Invalid check"),
        ]
        for body, message in bodies:
            reply = requests.put(url, json=body, timeout=5)
            assert reply.status_code == 400 and message in reply.text, (body, reply.text)
        assert requests.put(url, data=b"{not json", timeout=5).status_code == 400
        assert requests.put(f"{double.url}/v1/agent/service/deregister/nope", timeout=5).status_code == 404
        assert requests.get(f"{double.url}/v1/agent/services", timeout=5).json() == {}

    async def through_discovery() -> None:
        with _double() as double:
            discovery = _discovery(double)
            with pytest.raises(DiscoveryError, match="Invalid Service Meta"):
                await discovery.register(Endpoint("engine", "e", "127.0.0.1:1", meta=(("bad key", "v"),)))

    asyncio.run(through_discovery())


def test_no_agent_is_a_clear_error_and_deregister_does_not_raise() -> None:
    async def scenario() -> None:
        with _double() as double:
            port = double.port
        discovery = ConsulDiscovery("127.0.0.1", port, timeout_s=1.0)
        with pytest.raises(DiscoveryError, match=f"no Consul agent answers at http://127.0.0.1:{port}"):
            await discovery.leader()
        with pytest.raises(DiscoveryError, match="cannot register engine engine-0"):
            await discovery.register(Endpoint("engine", "engine-0", "127.0.0.1:1"))
        await discovery.deregister("engine-0")

    asyncio.run(scenario())


def test_acl_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        with ConsulDouble(required_token="s3cret") as double:
            monkeypatch.setenv("CONSUL_HTTP_ADDR", double.url)
            monkeypatch.delenv("CONSUL_HTTP_TOKEN", raising=False)
            with pytest.raises(DiscoveryError, match="ACL not found"):
                await ConsulDiscovery.from_env().register(Endpoint("engine", "engine-0", "127.0.0.1:1"))
            monkeypatch.setenv("CONSUL_HTTP_TOKEN", "s3cret")
            await ConsulDiscovery.from_env().register(Endpoint("engine", "engine-0", "127.0.0.1:1"))
            assert double.tokens_seen == ["s3cret"]

    asyncio.run(scenario())
