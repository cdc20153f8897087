"""mesh/service.py and mesh.grpcutil.Service: the shape every service process shares.

Reflection lets a stub-less client (grpcurl) discover and describe a service; serve_grpc serves
until a signal, then stops in order (not serving, grace, withdraw, on_stop).
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

import grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from mesh.grpcutil import Service, check_health
from mesh.service import serve_grpc
from services.cache.server import CacheServicer, add_to
from services.cache.sessions import SessionStore
from services.cache.store import BlockStore


@dataclass(frozen=True)
class Config:
    replica_id: str = "cache-t"
    host: str = "127.0.0.1"
    advertise: str = ""
    discovery: str = "static"


def cache_service() -> Service:
    service = Service("meshpb.v1.Cache", "127.0.0.1", 0)
    add_to(service, CacheServicer(SessionStore(ttl_s=60), BlockStore.create(hot_bytes=1 << 20)))
    return service


def describe(address: str) -> tuple[list[str], list[str]]:
    """What grpcurl would see: the service list and the Cache service's methods (blocking)."""
    with grpc.insecure_channel(address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = sorted(db.get_services())
        proto = db.FindFileContainingSymbol("meshpb.v1.Cache")
        methods = sorted(m.name for s in proto.service for m in s.method if s.name == "Cache")
        return services, methods


def test_reflection_lists_and_describes_the_service() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        service = cache_service()
        await service.start()
        try:
            return await asyncio.to_thread(describe, f"127.0.0.1:{service.port}")
        finally:
            await service.stop(grace=0)

    services, methods = asyncio.run(scenario())
    assert services == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "meshpb.v1.Cache"]
    assert {"GetSession", "AppendSession", "MatchPrefix", "GetBlocks", "PutBlocks"} <= set(methods)


def test_serve_grpc_serves_until_a_signal_then_stops_in_order() -> None:
    events: list[str] = []

    async def scenario() -> None:
        service = cache_service()
        address = f"127.0.0.1:{service.port}"

        async def on_stop() -> None:
            events.append("on_stop:serving" if await check_health(address) else "on_stop:stopped")

        serving = asyncio.create_task(serve_grpc("cache", Config(), service, on_stop=on_stop))
        for _ in range(100):
            if await check_health(address):
                break
            await asyncio.sleep(0.02)
        events.append("serving" if await check_health(address) else "never served")
        os.kill(os.getpid(), signal.SIGTERM)        # caught by serve_grpc's handler on this loop
        await asyncio.wait_for(serving, 10)
        events.append("returned")

    asyncio.run(scenario())
    assert events == ["serving", "on_stop:stopped", "returned"]
