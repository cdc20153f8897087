"""The router's LoRA RPCs (the edge's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, `infermesh lora`):
a mixin of RouterServicer (services/router/server.py); the work is services/router/lora.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from mesh.grpcutil import rpc_errors
from meshpb.v1 import router_pb2

if TYPE_CHECKING:
    from services.router.admin import Admin
    from services.router.callers import Callers
    from services.router.lora import LoraAdapters


class LoraRPCs:
    callers: Callers
    admin: Admin
    lora: LoraAdapters

    @rpc_errors
    async def LoadLoraAdapter(self, request: router_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
                              ) -> router_pb2.LoraAdaptersResponse:
        self.callers.check_admin(context, "LoadLoraAdapter")
        model = self.admin.resolve(request.model)
        await self.lora.load(request.name, request.path, model, request.replica)
        return self.lora_listing()

    @rpc_errors
    async def UnloadLoraAdapter(self, request: router_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> router_pb2.LoraAdaptersResponse:
        self.callers.check_admin(context, "UnloadLoraAdapter")
        await self.lora.unload(request.name)
        return self.lora_listing()

    @rpc_errors
    async def ListLoraAdapters(self, request: router_pb2.ListLoraAdaptersRequest,
                               context: grpc.aio.ServicerContext) -> router_pb2.LoraAdaptersResponse:
        self.callers.check_user(context, "ListLoraAdapters")
        return self.lora_listing()

    def lora_listing(self) -> router_pb2.LoraAdaptersResponse:
        reply = router_pb2.LoraAdaptersResponse()
        for lora, replicas in self.lora.known():
            reply.adapters.add(name=lora.name, model=lora.model, path=lora.path, replicas=replicas)
        return reply
