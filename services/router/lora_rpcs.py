"""The router's LoRA RPCs (the edge's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, `infermesh lora`):
a mixin of RouterServicer (services/router/server.py); the work is services/router/lora.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from mesh.grpcutil import rpc_errors
from services.router import wire

if TYPE_CHECKING:
    from services.router.admin import Admin
    from services.router.callers import Callers
    from services.router.lora import LoraAdapters


class LoraRPCs:
    callers: Callers
    admin: Admin
    lora: LoraAdapters

    @rpc_errors
    async def LoadLoraAdapter(self, request: wire.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
                              ) -> wire.LoraAdaptersResponse:
        self.callers.check_admin(context, "LoadLoraAdapter")
        model = self.admin.resolve(request.model)
        await self.lora.load(request.name, request.path, model, request.replica)
        return self.lora_listing()

    @rpc_errors
    async def UnloadLoraAdapter(self, request: wire.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> wire.LoraAdaptersResponse:
        self.callers.check_admin(context, "UnloadLoraAdapter")
        await self.lora.unload(request.name)
        return self.lora_listing()

    @rpc_errors
    async def ListLoraAdapters(self, request: wire.ListLoraAdaptersRequest,
                               context: grpc.aio.ServicerContext) -> wire.LoraAdaptersResponse:
        self.callers.check_user(context, "ListLoraAdapters")
        return self.lora_listing()

    def lora_listing(self) -> wire.LoraAdaptersResponse:
        return wire.lora_listing_pb(self.lora.known())
