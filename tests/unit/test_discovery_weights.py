"""Replica weights from discovery: Endpoint.weight, the static file, Consul entries, the replica table."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from mesh.discovery import Endpoint, HealthCheck, load_endpoints
from mesh.discovery.consul import registration, to_endpoint
from services.router.replicas import ReplicaTable


def test_endpoint_weight_defaults_to_one_and_refuses_what_is_no_weight() -> None:
    assert Endpoint("engine", "e", "h:1").weight == 1.0
    assert Endpoint("engine", "e", "h:1", weight=3).weight == 3.0
    assert Endpoint("engine", "e", "h:1", weight=0).weight == 0.0          # a standby
    for bad in (-1, math.inf, math.nan, "heavy", True):
        with pytest.raises(ValueError, match="engine e: weight"):
            Endpoint("engine", "e", "h:1", weight=bad)  # type: ignore[arg-type]


def test_the_static_file_reads_weights(tmp_path: Path) -> None:
    path = tmp_path / "discovery.json"
    path.write_text(json.dumps([
        {"service": "engine", "replica_id": "big", "address": "h:1", "weight": 3},
        {"service": "engine", "replica_id": "spare", "address": "h:2", "weight": 0},
        {"service": "engine", "replica_id": "plain", "address": "h:3"}]))
    assert [(e.replica_id, e.weight) for e in load_endpoints(str(path))] == [("big", 3.0), ("spare", 0.0),
                                                                             ("plain", 1.0)]


@pytest.mark.parametrize("weight", [-2, "lots", None, [3]])
def test_the_static_file_refuses_a_bad_weight_naming_the_entry(tmp_path: Path, weight: object) -> None:
    path = tmp_path / "discovery.json"
    path.write_text(json.dumps([{"service": "engine", "replica_id": "e1", "address": "h:1", "weight": weight}]))
    with pytest.raises(ValueError, match=r"discovery file .*: entry 0 \(e1\): weight"):
        load_endpoints(str(path))


def _entry(meta: dict[str, str], weights: dict[str, int] | None = None) -> dict[str, object]:
    service: dict[str, object] = {"ID": "engine-1", "Service": "engine", "Address": "10.0.0.7", "Port": 50061,
                                  "Meta": {"model": "m", **meta}}
    if weights is not None:
        service["Weights"] = weights
    return {"Node": {"Address": "10.0.0.9"}, "Service": service}


def test_consul_weight_from_meta_else_weights_passing_else_one() -> None:
    e = to_endpoint("engine", _entry({"weight": "2.5", "device": "cpu"}, {"Passing": 7, "Warning": 1}))
    assert e is not None and e.weight == 2.5 and e.meta == (("device", "cpu"),)   # not left in meta
    e = to_endpoint("engine", _entry({}, {"Passing": 7, "Warning": 1}))
    assert e is not None and e.weight == 7.0
    e = to_endpoint("engine", _entry({"weight": "0"}))
    assert e is not None and e.weight == 0.0
    e = to_endpoint("engine", _entry({}))
    assert e is not None and e.weight == 1.0


def test_a_malformed_consul_weight_is_logged_and_read_as_one(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mesh.discovery.consul"):
        e = to_endpoint("engine", _entry({"weight": "-3"}))
    assert e is not None and e.weight == 1.0
    assert "consul service engine-1: weight '-3' must be a finite number >= 0" in caplog.text


def test_registration_writes_a_weight_other_than_one_to_meta_and_reads_back() -> None:
    e = Endpoint("engine", "engine-1", "10.0.0.7:50061", "m", weight=4)
    kw = registration(e, HealthCheck.grpc(e.address))
    assert kw["meta"]["weight"] == "4"
    assert "weight" not in registration(Endpoint("engine", "x", "h:1"), HealthCheck.grpc("h:1"))["meta"]
    back = to_endpoint("engine", {"Service": {"ID": "engine-1", "Address": "10.0.0.7", "Port": 50061,
                                              "Meta": kw["meta"]}})
    assert back is not None and back.weight == 4.0
    with pytest.raises(ValueError, match="weight"):
        registration(Endpoint("engine", "y", "h:1", meta=(("weight", "2"),)), HealthCheck.grpc("h:1"))


def test_the_table_takes_weights_and_applies_a_new_one_in_place() -> None:
    table = ReplicaTable()
    added, _ = table.sync([Endpoint("engine", "a", "a:1", weight=3), Endpoint("engine", "b", "b:1")])
    assert [(r.replica_id, r.weight) for r in added] == [("a", 3.0), ("b", 1.0)]
    a = table.get("a")
    assert a is not None
    a.in_flight = 2
    assert table.sync([Endpoint("engine", "a", "a:1", weight=0.5), Endpoint("engine", "b", "b:1")]) == ([], [])
    assert table.get("a") is a and a.weight == 0.5 and a.in_flight == 2      # same replica, state kept
