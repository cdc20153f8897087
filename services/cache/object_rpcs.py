"""The object RPCs of meshpb.v1.Cache (PutObject, GetObject, DeleteObject, ListObjects), as a mixin for the cache
servicer (which sets `self.objects`, an ObjectStore: services/cache/objects.py).  Edge certificates only: the edge
names the tenant, whose values no other tenant's request can reach."""

from __future__ import annotations

import grpc

from mesh import peers
from mesh.grpcutil import rpc_errors
from meshpb.v1 import cache_pb2
from services.cache.objects import Key, ObjectStore


def _key(key: cache_pb2.ObjectKey) -> Key:
    return key.tenant, key.kind, key.id


class ObjectRPCs:
    objects: ObjectStore

    @rpc_errors
    async def PutObject(self, request: cache_pb2.PutObjectRequest, context: grpc.aio.ServicerContext
                        ) -> cache_pb2.PutObjectReply:
        peers.require(context, "PutObject", peers.RESPONSES)
        self.objects.put(_key(request.key), request.value, request.ttl_s)
        return cache_pb2.PutObjectReply()

    @rpc_errors
    async def GetObject(self, request: cache_pb2.ObjectKey, context: grpc.aio.ServicerContext
                        ) -> cache_pb2.GetObjectReply:
        peers.require(context, "GetObject", peers.RESPONSES)
        value = self.objects.get(_key(request))
        return cache_pb2.GetObjectReply(found=value is not None, value=value or b"")

    @rpc_errors
    async def DeleteObject(self, request: cache_pb2.ObjectKey, context: grpc.aio.ServicerContext
                           ) -> cache_pb2.DeleteObjectReply:
        peers.require(context, "DeleteObject", peers.RESPONSES)
        return cache_pb2.DeleteObjectReply(found=self.objects.delete(_key(request)))


    @rpc_errors
    async def ListObjects(self, request: cache_pb2.ListObjectsRequest, context: grpc.aio.ServicerContext
                          ) -> cache_pb2.ListObjectsReply:
        peers.require(context, "ListObjects", peers.RESPONSES)
        keys = self.objects.keys(None if request.all_tenants else request.tenant, request.kind)
        return cache_pb2.ListObjectsReply(keys=[cache_pb2.ObjectKey(tenant=t, kind=k, id=i) for t, k, i in keys])
