"""The edge's stored objects (stored Responses API responses, files, batches): the cache service's PutObject,
GetObject, DeleteObject and ListObjects under the caller's tenant, kept on its disk across restarts
(services/cache/objects.py); an edge without a cache service keeps them in its own memory (lost with it).  A
cache service that cannot be reached is a 503 with a retry hint."""

from __future__ import annotations

import time
from typing import Any

import grpc

from mesh.grpcutil import channel
from mesh.telemetry import outgoing_metadata
from meshpb.v1 import cache_pb2, cache_pb2_grpc
from services.edge.errors import ApiError

TIMEOUT_S = 5.0
TTL_S = 30 * 86400.0          # the cache service's longest


class StoredObjects:
    def __init__(self, address: str = ""):
        self._channel = channel(address) if address else None
        self._stub = cache_pb2_grpc.CacheStub(self._channel) if self._channel else None
        self._local: dict[tuple[str, str, str], tuple[bytes, float]] = {}

    async def put(self, tenant: str, kind: str, oid: str, value: bytes, ttl_s: float = TTL_S) -> None:
        if self._stub is None:
            self._local[(tenant, kind, oid)] = (value, time.time() + ttl_s)
            return
        key = cache_pb2.ObjectKey(tenant=tenant, kind=kind, id=oid)
        await self._call(self._stub.PutObject, cache_pb2.PutObjectRequest(key=key, value=value, ttl_s=ttl_s))

    async def get(self, tenant: str, kind: str, oid: str) -> bytes | None:
        if self._stub is None:
            value, expires = self._local.get((tenant, kind, oid), (None, 0.0))
            return value if expires > time.time() else None
        reply = await self._call(self._stub.GetObject, cache_pb2.ObjectKey(tenant=tenant, kind=kind, id=oid))
        return bytes(reply.value) if reply.found else None

    async def delete(self, tenant: str, kind: str, oid: str) -> bool:
        if self._stub is None:
            return self._local.pop((tenant, kind, oid), None) is not None
        reply = await self._call(self._stub.DeleteObject, cache_pb2.ObjectKey(tenant=tenant, kind=kind, id=oid))
        return bool(reply.found)

    async def keys(self, tenant: str | None, kind: str) -> list[tuple[str, str]]:
        """(tenant, id) of the live objects of `kind`: `tenant`'s, or every tenant's (None), by id."""
        if self._stub is None:
            now = time.time()
            found = [(k[0], k[2]) for k, (_, expires) in self._local.items()
                     if k[1] == kind and (tenant is None or k[0] == tenant) and expires > now]
            return sorted(found, key=lambda k: (k[1], k[0]))
        request = cache_pb2.ListObjectsRequest(tenant=tenant or "", kind=kind, all_tenants=tenant is None)
        reply = await self._call(self._stub.ListObjects, request)
        return [(k.tenant, k.id) for k in reply.keys]

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=TIMEOUT_S, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ApiError(400, err.details() or "refused by the object store") from None
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ApiError(429, err.details() or "the object store is full", kind="insufficient_quota",
                               code="insufficient_quota", retry_after_s=60) from None
            raise ApiError(503, f"the object store is unreachable ({err.code().name}); retry shortly",
                           kind="service_unavailable", code="overloaded", retry_after_s=1) from None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
