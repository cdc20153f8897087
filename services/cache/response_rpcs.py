"""The response-cache RPCs of meshpb.v1.Cache, as a mixin for the cache servicer (which sets
`self.responses`, a ResponseStore).  Edge certificates only: a value is a whole answer to one tenant."""

from __future__ import annotations

import time

import grpc

from mesh import peers
from mesh.grpcutil import rpc_errors
from meshpb.v1 import cache_pb2
from services.cache.responses import ResponseStore


class ResponseRPCs:
    responses: ResponseStore

    @rpc_errors
    async def GetResponse(self, request: cache_pb2.GetResponseRequest, context: grpc.aio.ServicerContext
                          ) -> cache_pb2.GetResponseReply:
        peers.require(context, "GetResponse", peers.RESPONSES)
        value = self.responses.get(request.key, time.monotonic())
        return cache_pb2.GetResponseReply(found=value is not None, value=value or b"")

    @rpc_errors
    async def PutResponse(self, request: cache_pb2.PutResponseRequest, context: grpc.aio.ServicerContext
                          ) -> cache_pb2.PutResponseReply:
        peers.require(context, "PutResponse", peers.RESPONSES)
        stored = self.responses.put(request.key, request.value, request.ttl_s, time.monotonic())
        return cache_pb2.PutResponseReply(stored=stored)
