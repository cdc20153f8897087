"""The cache service in-process over real gRPC: session context with a sliding TTL."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mesh.grpcutil import Service, channel, check_health
from meshpb.v1 import cache_pb2, cache_pb2_grpc, tokenizer_pb2
from services.cache.server import CacheServicer, add_to
from services.cache.sessions import SessionStore
from services.cache.store import BlockStore


def test_sessions_over_grpc() -> None:
    async def scenario() -> None:
        service = Service("meshpb.v1.Cache", "127.0.0.1", 0)
        add_to(service, CacheServicer(SessionStore(ttl_s=1800), BlockStore.create(hot_bytes=1 << 20)))
        await service.start()
        await service.ready()
        address = f"127.0.0.1:{service.port}"
        try:
            assert await check_health(address)
            async with channel(address) as ch:
                stub = cache_pb2_grpc.CacheStub(ch)
                missing = await stub.GetSession(cache_pb2.SessionRequest(session_id="s1"))
                assert not missing.found
                msg = tokenizer_pb2.ChatMessage(role="user", content="hello")
                await stub.AppendSession(cache_pb2.AppendSessionRequest(session_id="s1", messages=[msg]))
                got = await stub.AppendSession(cache_pb2.AppendSessionRequest(
                    session_id="s1", messages=[tokenizer_pb2.ChatMessage(role="assistant", content="hi!")]))
                assert got.found and [m.content for m in got.messages] == ["hello", "hi!"]
                assert got.expires_unix_ms > 0
                stats = await stub.GetStats(cache_pb2.CacheStatsRequest())
                assert stats.sessions == 1
                assert (await stub.DeleteSession(cache_pb2.SessionRequest(session_id="s1"))).found
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.GetSession(cache_pb2.SessionRequest(session_id=""))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model="m", hashes=[bytes(16)]))
                        ).matched == 0
        finally:
            await service.stop(0)
        assert not await check_health(address)

    asyncio.run(scenario())
