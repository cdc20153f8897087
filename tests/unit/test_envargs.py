import argparse
import json

import pytest

from mesh.discovery import advertise_address, load_endpoints
from mesh.envargs import apply_env


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--kv-cache-mb", type=int, default=1024)
    p.add_argument("--dtype", choices=["auto", "float32"], default="auto")
    p.add_argument("--engine", action="append", default=[])
    p.add_argument("--verbose", action="store_true")
    return p


def test_environment_sets_defaults_and_flags_win() -> None:
    p = parser()
    apply_env(p, "X", {"X_KV_CACHE_MB": "512", "X_ENGINE": "a=h:1, b=h:2", "X_VERBOSE": "true"})
    a = p.parse_args([])
    assert (a.kv_cache_mb, a.engine, a.verbose, a.dtype) == (512, ["a=h:1", "b=h:2"], True, "auto")
    assert p.parse_args(["--kv-cache-mb", "64"]).kv_cache_mb == 64


@pytest.mark.parametrize("env", [{"X_KV_CACHE_MB": "lots"}, {"X_DTYPE": "float16"}])
def test_bad_environment_values_are_refused_by_name(env: dict[str, str]) -> None:
    p = parser()
    with pytest.raises(SystemExit):
        apply_env(p, "X", env)


def test_advertised_address() -> None:
    assert advertise_address("127.0.0.1", 50060) == "127.0.0.1:50060"
    assert advertise_address("0.0.0.0", 50060, "engine-a0") == "engine-a0:50060"
    assert advertise_address("0.0.0.0", 50060, "10.0.0.2:7000") == "10.0.0.2:7000"
    assert advertise_address("0.0.0.0", 50060).endswith(":50060")
    assert not advertise_address("0.0.0.0", 50060).startswith("0.0.0.0")


def test_discovery_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "mesh.json"
    f.write_text(json.dumps([{"service": "engine", "replica_id": "a0", "address": "10.0.0.2:50060", "region": "a"},
                             {"service": "engine", "replica_id": "b0", "address": "10.0.0.3:50060", "region": "b"}]))
    engines = load_endpoints(str(f))
    assert [(e.replica_id, e.region) for e in engines] == [("a0", "a"), ("b0", "b")]
    f.write_text(json.dumps([{"service": "engine", "replica_id": "a0"}]))
    with pytest.raises(ValueError, match="entry 0 needs"):
        load_endpoints(str(f))
    f.write_text(json.dumps([{"service": "engine", "replica_id": "a0", "address": "x:1", "zone": "z"}]))
    with pytest.raises(ValueError, match="unknown field"):
        load_endpoints(str(f))
