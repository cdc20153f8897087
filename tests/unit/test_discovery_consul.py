"""The Consul backend's pure parts: agent address, check and registration bodies, entries, index, backoff."""

from __future__ import annotations

import pytest

from mesh.discovery import Endpoint, HealthCheck
from mesh.discovery.consul import (
    ConsulDiscovery,
    backoff_s,
    check_definition,
    go_duration,
    next_index,
    parse_agent_address,
    registration,
    to_endpoint,
    to_endpoints,
)


@pytest.mark.parametrize("value,ssl,expected", [
    ("", False, ("http", "127.0.0.1", 8500)),
    ("127.0.0.1:8500", False, ("http", "127.0.0.1", 8500)),
    ("http://consul.local:8500", False, ("http", "consul.local", 8500)),
    ("https://consul.local:8501/", False, ("https", "consul.local", 8501)),
    ("consul.local", False, ("http", "consul.local", 8500)),
    ("10.0.0.5:8501", True, ("https", "10.0.0.5", 8501)),
    ("http://10.0.0.5:8500", True, ("http", "10.0.0.5", 8500)),
    ("[::1]:8500", False, ("http", "::1", 8500)),
    ("http://[::1]", False, ("http", "::1", 8500)),
])
def test_parse_agent_address(value: str, ssl: bool, expected: tuple[str, str, int]) -> None:
    assert parse_agent_address(value, ssl=ssl) == expected


@pytest.mark.parametrize("bad", ["unix:///var/run/consul.sock", "http://host:8500/v1", "http://", "host:port"])
def test_parse_agent_address_refuses(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_agent_address(bad)


def test_from_env_reads_consuls_variables() -> None:
    d = ConsulDiscovery.from_env({"CONSUL_HTTP_ADDR": "consul.local:9500", "CONSUL_HTTP_SSL": "true"})
    assert d.agent_url == "https://consul.local:9500"
    assert ConsulDiscovery.from_env({}).agent_url == "http://127.0.0.1:8500"


@pytest.mark.parametrize("seconds,text", [(2, "2s"), (60.0, "60s"), (0.5, "500ms"), (0.0004, "1ms")])
def test_go_duration(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_grpc_check_definition_is_consuls_grpc_check() -> None:
    d = check_definition(HealthCheck.grpc("127.0.0.1:50060", interval_s=2, timeout_s=1, deregister_after_s=60), "n")
    assert d == {"Name": "n", "grpc": "127.0.0.1:50060", "interval": "2s", "grpc_use_tls": False, "timeout": "1s",
                 "DeregisterCriticalServiceAfter": "60s"}


def test_http_check_definition_for_the_edge() -> None:
    d = check_definition(HealthCheck.http("http://127.0.0.1:8000/health", interval_s=0.5), "edge")
    assert d["http"] == "http://127.0.0.1:8000/health" and d["interval"] == "500ms"
    assert "grpc" not in d


def test_registration_carries_model_version_region_in_meta_and_tags() -> None:
    e = Endpoint("engine", "engine-1", "127.0.0.1:50061", "smollm2", "2", "eu-west", (("device", "cpu"),),
                 ("canary",))
    kw = registration(e, HealthCheck.grpc(e.address))
    assert kw["name"] == "engine" and kw["service_id"] == "engine-1"
    assert (kw["address"], kw["port"]) == ("127.0.0.1", 50061)
    assert kw["meta"] == {"device": "cpu", "model": "smollm2", "model_version": "2", "region": "eu-west",
                          "replica_id": "engine-1"}
    assert kw["tags"] == ["infermesh", "region=eu-west", "model=smollm2", "version=2", "canary"]
    assert kw["check"]["grpc"] == "127.0.0.1:50061" and kw["replace_existing_checks"] is True


def test_registration_refuses_meta_that_shadows_fields() -> None:
    e = Endpoint("engine", "engine-1", "127.0.0.1:50061", meta=(("model", "x"),))
    with pytest.raises(ValueError, match="model"):
        registration(e, HealthCheck.grpc(e.address))


def _entry(**service: object) -> dict[str, object]:
    return {"Node": {"Node": "n1", "Address": "10.0.0.9"},
            "Service": {"ID": "engine-1", "Service": "engine", "Address": "10.0.0.7", "Port": 50061,
                        "Tags": ["infermesh"], "Meta": {"model": "m", "model_version": "3", "region": "eu",
                                                        "replica_id": "engine-1", "device": "cpu"}, **service},
            "Checks": [{"Status": "passing"}]}


def test_entry_to_endpoint() -> None:
    assert to_endpoint("engine", _entry()) == Endpoint("engine", "engine-1", "10.0.0.7:50061", "m", "3", "eu",
                                                       (("device", "cpu"),), ("infermesh",))


def test_entry_without_service_address_uses_the_node_address() -> None:
    e = to_endpoint("engine", _entry(Address=""))
    assert e is not None and e.address == "10.0.0.9:50061"


def test_entry_without_meta_falls_back_to_the_service_id_and_defaults() -> None:
    e = to_endpoint("engine", _entry(Meta=None, Tags=None, Address="::1"))
    assert e == Endpoint("engine", "engine-1", "[::1]:50061")


@pytest.mark.parametrize("broken", [{"Port": 0}, {"Port": "50061"}, {"Port": 70000}])
def test_unusable_entries_are_skipped(broken: dict[str, object]) -> None:
    assert to_endpoint("engine", _entry(**broken)) is None
    assert to_endpoints("engine", [_entry(**broken), _entry(ID="engine-0", Meta={})])[0].replica_id == "engine-0"


def test_to_endpoints_sorts_and_accepts_none() -> None:
    entries = [_entry(ID="b", Meta={}), _entry(ID="a", Meta={})]
    assert [e.replica_id for e in to_endpoints("engine", entries)] == ["a", "b"]
    assert to_endpoints("engine", None) == []


@pytest.mark.parametrize("previous,returned,expected", [
    (0, 42, 42),       # first answer
    (42, 42, 42),      # wait elapsed without a change
    (42, 57, 57),      # something changed
    (57, 12, 0),       # went backwards: reset, the next query answers at once
    (0, 0, 1),         # never block on 0 (Consul's docs: treat as 1)
])
def test_next_index_follows_consuls_rules(previous: int, returned: int, expected: int) -> None:
    assert next_index(previous, returned) == expected


def test_backoff_grows_caps_and_jitters() -> None:
    assert [backoff_s(n, 0.0) for n in (1, 2, 3, 4)] == [0.25, 0.5, 1.0, 2.0]
    assert backoff_s(1, 0.999) == pytest.approx(0.5, abs=1e-3)
    assert backoff_s(50, 0.0) == 5.0 and backoff_s(50, 0.999) <= 10.0
    assert len({backoff_s(3, r / 10) for r in range(10)}) == 10


def test_consul_discovery_validates_its_knobs() -> None:
    with pytest.raises(ValueError, match="wait_s"):
        ConsulDiscovery(wait_s=0)
