"""The discovery interface and the static backend: addresses, health-check specs, the fixed list."""

from __future__ import annotations

import asyncio

import pytest

from mesh.discovery import (
    Discovery,
    Endpoint,
    HealthCheck,
    StaticDiscovery,
    join_address,
    make_discovery,
    parse_endpoint,
    split_address,
)

E0 = Endpoint("engine", "engine-0", "127.0.0.1:50060", model="m", model_version="1")
E1 = Endpoint("engine", "engine-1", "127.0.0.1:50061", model="m", model_version="1")
TOK = Endpoint("tokenizer", "tokenizer-0", "127.0.0.1:50052")


def test_parse_endpoint_keeps_its_contract() -> None:
    assert parse_endpoint("engine", "engine-3=10.0.0.2:50063") == Endpoint("engine", "engine-3", "10.0.0.2:50063")
    assert parse_endpoint("engine", "10.0.0.2:50063").replica_id == "10.0.0.2:50063"
    with pytest.raises(ValueError, match="ID=HOST:PORT"):
        parse_endpoint("engine", "engine-3")


@pytest.mark.parametrize("address,parts", [
    ("127.0.0.1:8500", ("127.0.0.1", 8500)),
    ("consul.service:1", ("consul.service", 1)),
    ("[::1]:50051", ("::1", 50051)),
])
def test_split_and_join_address_round_trip(address: str, parts: tuple[str, int]) -> None:
    assert split_address(address) == parts
    assert join_address(*parts) == address


@pytest.mark.parametrize("bad", ["127.0.0.1", ":80", "host:", "host:0", "host:65536", "host:http", "::1:80"])
def test_split_address_refuses_what_cannot_be_dialled(bad: str) -> None:
    with pytest.raises(ValueError, match="HOST"):
        split_address(bad)


def test_health_check_specs() -> None:
    assert HealthCheck.grpc("127.0.0.1:50060").kind == "grpc"
    assert HealthCheck.grpc("127.0.0.1:50060/meshpb.v1.Engine", interval_s=5).interval_s == 5
    assert HealthCheck.http("http://127.0.0.1:8000/health").target.endswith("/health")
    for make, match in [
        (lambda: HealthCheck("tcp", "h:1"), "grpc or http"),
        (lambda: HealthCheck.http("127.0.0.1:8000/health"), "URL"),
        (lambda: HealthCheck.grpc("127.0.0.1"), "HOST:PORT"),
        (lambda: HealthCheck.grpc("h:1", interval_s=0), "positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            make()


def test_endpoint_tags_default_keeps_old_constructor_calls_working() -> None:
    e = Endpoint("engine", "engine-0", "127.0.0.1:50060", "m", "1", "eu", (("gpu", "h200"),))
    assert e.tags == () and e.meta == (("gpu", "h200"),)


def test_static_discovery_lists_per_service_sorted() -> None:
    d = StaticDiscovery([E1, TOK, E0])
    assert isinstance(d, Discovery)
    assert d.endpoints("engine") == [E0, E1]
    assert d.endpoints("tokenizer") == [TOK]
    assert d.endpoints("cache") == []


def test_static_watch_yields_once_then_waits_and_register_is_a_no_op() -> None:
    async def scenario() -> None:
        d = StaticDiscovery([E0, E1])
        await d.register(Endpoint("engine", "engine-9", "127.0.0.1:1"))
        await d.deregister("engine-0")
        stream = d.watch("engine")
        assert await anext(stream) == [E0, E1]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(stream), 0.05)
        await d.close()

    asyncio.run(scenario())


def test_static_list_changes_at_runtime_and_every_watcher_sees_it() -> None:
    """Issue 21: replicas added and drained at runtime with static discovery (the router's admin RPCs)."""
    async def scenario() -> None:
        d = StaticDiscovery([E0, TOK])
        first, second = d.watch("engine"), d.watch("engine")
        assert await anext(first) == [E0] and await anext(second) == [E0]
        await d.add(E1)
        assert await asyncio.wait_for(anext(first), 1) == [E0, E1]
        assert await d.remove("engine", "engine-0") and not await d.remove("engine", "engine-0")
        assert await asyncio.wait_for(anext(first), 1) == [E1]
        # A watcher that was busy meanwhile still gets the latest list; a change to another service is not news.
        assert await asyncio.wait_for(anext(second), 1) in ([E0, E1], [E1])
        await d.add(Endpoint("tokenizer", "tokenizer-1", "127.0.0.1:9"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(first), 0.05)

    asyncio.run(scenario())


def test_make_discovery_picks_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    static = make_discovery("static", [E0])
    assert isinstance(static, StaticDiscovery) and static.endpoints("engine") == [E0]
    monkeypatch.setenv("CONSUL_HTTP_ADDR", "http://10.1.2.3:8600")
    consul = make_discovery("consul")
    assert type(consul).__name__ == "ConsulDiscovery"
    assert consul.agent_url == "http://10.1.2.3:8600"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="static, consul"):
        make_discovery("dns")
