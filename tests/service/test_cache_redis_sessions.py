"""The cache service in-process over real gRPC with `--session-store redis://...` against a real
redis-server (tests/redis_server.py): the same contract as the embedded store (sliding TTL, limits,
errors), keys under a prefix, shared by replicas; Redis unreachable -> UNAVAILABLE naming it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import redis

from mesh.grpcutil import Service, channel
from meshpb.v1 import cache_pb2, cache_pb2_grpc, tokenizer_pb2
from services.cache.__main__ import open_sessions, parse
from services.cache.config import CacheConfig
from services.cache.redis_sessions import PREFIX
from services.cache.server import CacheServicer, add_to
from services.cache.store import BlockStore
from tests.redis_server import free_port, running_redis


@pytest.fixture(scope="module")
def redis_url(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_redis(redis_binary, tmp_path_factory.mktemp("redis")) as url:
        yield url


@contextlib.asynccontextmanager
async def cache_service(config: CacheConfig) -> AsyncIterator[cache_pb2_grpc.CacheStub]:
    """The cache service as `python -m services.cache` builds it, on a free port."""
    sessions = await open_sessions(config)
    service = Service("meshpb.v1.Cache", "127.0.0.1", 0)
    add_to(service, CacheServicer(sessions, BlockStore.create(hot_bytes=1 << 20)))
    await service.start()
    await service.ready()
    try:
        async with channel(f"127.0.0.1:{service.port}") as ch:
            yield cache_pb2_grpc.CacheStub(ch)
    finally:
        await service.stop(0)
        await sessions.close()


def msg(role: str, content: str, **extra: str) -> tokenizer_pb2.ChatMessage:
    return tokenizer_pb2.ChatMessage(role=role, content=content, **extra)


async def append(stub: cache_pb2_grpc.CacheStub, sid: str, *messages: tokenizer_pb2.ChatMessage
                 ) -> cache_pb2.SessionContext:
    return await stub.AppendSession(cache_pb2.AppendSessionRequest(session_id=sid, messages=messages))


async def get(stub: cache_pb2_grpc.CacheStub, sid: str) -> cache_pb2.SessionContext:
    return await stub.GetSession(cache_pb2.SessionRequest(session_id=sid))


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call                                         # type: ignore[misc]
    return err.value


def test_sessions_live_in_redis_under_a_prefix_with_the_ttl(redis_url: str) -> None:
    url = f"{redis_url}/1"
    direct = redis.Redis.from_url(url, decode_responses=True)
    call = '[{"id": "c1", "type": "function"}]'

    async def scenario() -> None:
        async with cache_service(parse(["--session-store", url])) as stub:
            assert not (await get(stub, "t/s1")).found
            await append(stub, "t/s1", msg("user", "héllo"), msg("assistant", "", tool_calls=call))
            got = await append(stub, "t/s1", msg("tool", "42", tool_call_id="c1", name="calc"))
            assert got.found and [(m.role, m.content) for m in got.messages] == [
                ("user", "héllo"), ("assistant", ""), ("tool", "42")]
            assert (got.messages[1].tool_calls, got.messages[2].tool_call_id, got.messages[2].name) == (
                call, "c1", "calc")
            assert abs(got.expires_unix_ms / 1000 - (time.time() + 1800)) < 5   # the default 30 minutes
            # In Redis: one list under the prefix, expiring with the TTL.
            assert direct.keys("*") == [f"{PREFIX}t/s1"]
            assert direct.type(f"{PREFIX}t/s1") == "list"
            assert 1_790_000 < direct.pttl(f"{PREFIX}t/s1") <= 1_800_000
            assert json.loads(str(direct.lindex(f"{PREFIX}t/s1", 0))) == ["user", "héllo", "", "", ""]
            assert [m.content for m in (await get(stub, "t/s1")).messages] == ["héllo", "", "42"]
            assert (await stub.GetStats(cache_pb2.CacheStatsRequest())).sessions == 1
            assert (await stub.DeleteSession(cache_pb2.SessionRequest(session_id="t/s1"))).found
            assert not (await stub.DeleteSession(cache_pb2.SessionRequest(session_id="t/s1"))).found
            assert not (await get(stub, "t/s1")).found
            assert direct.keys("*") == []

    asyncio.run(scenario())
    direct.close()


def test_ttl_slides_with_every_read_and_write(redis_url: str) -> None:
    url = f"{redis_url}/2"
    direct = redis.Redis.from_url(url)

    async def scenario() -> None:
        async with cache_service(parse(["--session-store", url, "--session-ttl", "2"])) as stub:
            await append(stub, "s", msg("user", "one"))
            await asyncio.sleep(1.2)
            assert (await get(stub, "s")).found           # read at 1.2 s: lives to 3.2 s
            assert direct.pttl(f"{PREFIX}s") > 1500
            await asyncio.sleep(1.2)
            await append(stub, "s", msg("assistant", "two"))   # 2.4 s after the first write: still there
            await asyncio.sleep(1.2)
            got = await get(stub, "s")
            assert [m.content for m in got.messages] == ["one", "two"]
            await asyncio.sleep(2.3)                       # untouched for longer than the TTL
            assert not (await get(stub, "s")).found
            assert direct.exists(f"{PREFIX}s") == 0

    asyncio.run(scenario())
    direct.close()


@pytest.mark.parametrize("store", ["embedded", "redis"])
def test_limits_and_errors_are_the_embedded_stores(redis_url: str, store: str) -> None:
    config = CacheConfig(session_store=f"{redis_url}/3" if store == "redis" else "embedded",
                         max_messages_per_session=3)

    async def scenario() -> None:
        async with cache_service(config) as stub:
            await append(stub, "s", msg("user", "a"), msg("assistant", "b"))
            err = await refused(append(stub, "s", msg("user", "c"), msg("assistant", "d")))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.details() == "session 's' would exceed 3 messages; delete it or start a new one"
            assert [m.content for m in (await get(stub, "s")).messages] == ["a", "b"]   # nothing stored
            err = await refused(append(stub, "new", *(msg("user", str(i)) for i in range(4))))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not (await get(stub, "new")).found
            for bad, why in (("", "session_id is empty"), ("x" * 321, "session_id is longer than 320 characters")):
                for call in (get(stub, bad), append(stub, bad, msg("user", "a")),
                             stub.DeleteSession(cache_pb2.SessionRequest(session_id=bad))):
                    err = await refused(call)
                    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, why)
            assert (await append(stub, "x" * 320, msg("user", "longest id"))).found
            assert (await stub.DeleteSession(cache_pb2.SessionRequest(session_id="s"))).found
            assert (await stub.DeleteSession(cache_pb2.SessionRequest(session_id="x" * 320))).found

    asyncio.run(scenario())


def test_two_cache_replicas_share_one_redis(redis_url: str) -> None:
    config = parse(["--session-store", f"{redis_url}/4"])

    async def scenario() -> None:
        async with cache_service(config) as a, cache_service(replace(config, replica_id="cache-1")) as b:
            await append(a, "s", msg("user", "hi"))
            got = await append(b, "s", msg("assistant", "hello"))
            assert [m.content for m in got.messages] == ["hi", "hello"]
            assert [m.content for m in (await get(a, "s")).messages] == ["hi", "hello"]

    asyncio.run(scenario())


def test_a_full_redis_refuses_appends_but_serves_reads(redis_url: str) -> None:
    url = f"{redis_url}/5"
    direct = redis.Redis.from_url(url)

    async def scenario() -> None:
        async with cache_service(parse(["--session-store", url])) as stub:
            await append(stub, "s", msg("user", "hi"))
            direct.config_set("maxmemory", 1)              # with the default policy, noeviction
            try:
                err = await refused(append(stub, "s", msg("user", "more")))
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "maxmemory" in err.details()
                assert [m.content for m in (await get(stub, "s")).messages] == ["hi"]
            finally:
                direct.config_set("maxmemory", 0)
            assert len((await append(stub, "s", msg("user", "more"))).messages) == 2

    asyncio.run(scenario())
    direct.close()


def test_unreachable_redis_answers_unavailable_and_recovers(redis_binary: str, tmp_path: Path) -> None:
    port = free_port()
    address = f"redis://127.0.0.1:{port}/0"

    async def down(stub: cache_pb2_grpc.CacheStub) -> None:
        for call in (get(stub, "s"), append(stub, "s", msg("user", "hi")),
                     stub.DeleteSession(cache_pb2.SessionRequest(session_id="s"))):
            started = time.monotonic()
            err = await refused(call)
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert address in err.details(), err.details()
            assert time.monotonic() - started < 3.5         # well inside the router's 5 s
        # The KV block side still answers; sessions read 0.
        assert (await stub.GetStats(cache_pb2.CacheStatsRequest())).sessions == 0

    async def scenario() -> None:
        async with cache_service(parse(["--session-store", f"redis://127.0.0.1:{port}"])) as stub:
            await down(stub)                                # Redis not started yet: the service still starts
            with running_redis(redis_binary, tmp_path, port):
                assert not (await get(stub, "s")).found       # reconnects by itself
                assert (await append(stub, "s", msg("user", "hi"))).found
            await down(stub)                                # Redis gone while serving (pooled connections dead)

    asyncio.run(scenario())
