"""`--session-store embedded|redis://...`: parsed and refused with a clear message, from `infermesh up`
through the launcher's plan to the cache service's config."""

from __future__ import annotations

import pytest

from infermesh.cli import main
from infermesh.launcher import MeshConfig, plan
from services.cache.__main__ import parse
from services.cache.config import CacheConfig, RedisAddress, redis_address


@pytest.mark.parametrize("url,address", [
    ("embedded", None),
    ("redis://127.0.0.1:6380/2", RedisAddress("127.0.0.1", 6380, 2)),
    ("redis://cache.internal", RedisAddress("cache.internal", 6379, 0)),
    ("redis://h:7/", RedisAddress("h", 7, 0)),
    ("redis://ops:p%40ss@[::1]:7/3", RedisAddress("::1", 7, 3, "ops", "p@ss")),
])
def test_session_store_urls(url: str, address: RedisAddress | None) -> None:
    assert redis_address(url) == address


@pytest.mark.parametrize("url,match", [
    ("", "neither 'embedded' nor a Redis URL"),
    ("memory", "neither 'embedded' nor a Redis URL"),
    ("rediss://h:1", "neither 'embedded' nor a Redis URL"),
    ("redis://", "is not a Redis URL"),
    ("redis://h:1/db", "is not a Redis URL"),
    ("redis://h:1/0?timeout=1", "is not a Redis URL"),
    ("redis://h:0", "port is not a number from 1 to 65535"),
    ("redis://h:70000", "port is not a number from 1 to 65535"),
])
def test_bad_session_stores_are_refused(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CacheConfig(session_store=url)
    with pytest.raises(ValueError, match=match):
        MeshConfig(session_store=url)


def test_a_password_is_never_echoed() -> None:
    address = redis_address("redis://:hunter2@h:1/0")
    assert address is not None and address.password == "hunter2" and "hunter2" not in f"{address}"
    with pytest.raises(ValueError) as err:
        redis_address("redis://:hunter2@h:1/zero")
    assert "hunter2" not in str(err.value)


def test_redis_and_a_journal_folder_contradict() -> None:
    with pytest.raises(ValueError, match="--sessions-dir keeps the embedded store's sessions"):
        CacheConfig(session_store="redis://h:1", sessions_dir="/tmp/s")


def test_the_cache_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse([]).redis is None
    assert parse(["--session-store", "redis://h:1/4", "--session-ttl", "2"]).redis == RedisAddress("h", 1, 4)
    monkeypatch.setenv("INFERMESH_CACHE_SESSION_STORE", "redis://h:2")
    assert parse([]).redis == RedisAddress("h", 2, 0)
    with pytest.raises(SystemExit):
        parse(["--session-store", "redis://h:1/x"])


def test_up_passes_the_store_to_the_cache_service(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    def cache(config: MeshConfig) -> tuple[list[str], dict[str, str]]:
        child = plan(config)[0][0]
        assert child.name == "cache-0"
        return child.argv, child.env

    argv, env = cache(MeshConfig(cache_dir=str(tmp_path)))
    assert "--session-store" not in argv and argv[argv.index("--sessions-dir") + 1] == str(tmp_path) and not env
    argv, env = cache(MeshConfig(cache_dir=str(tmp_path), session_store="redis://127.0.0.1:6390/1"))
    assert argv[argv.index("--session-store") + 1] == "redis://127.0.0.1:6390/1"
    assert "--sessions-dir" not in argv and "--cold-dir" in argv and not env      # Redis keeps the sessions
    # A password goes by the environment, which `ps` does not show.
    argv, env = cache(MeshConfig(session_store="redis://:hunter2@127.0.0.1:6390"))
    assert "hunter2" not in " ".join(argv) and "--sessions-dir" not in argv
    assert env == {"INFERMESH_CACHE_SESSION_STORE": "redis://:hunter2@127.0.0.1:6390"}
    assert main(["up", "--session-store", "redis://h:1/x"]) == 2
    assert "is not a Redis URL" in capsys.readouterr().err
