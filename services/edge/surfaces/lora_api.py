"""LoRA adapters at the edge, in vLLM's shapes: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}, with the admin key.  The router loads the folder on a replica of the
base model ("model", default: the default model; "replica" to choose one) and every router learns it; then a
request whose model is the adapter's name runs with it, and GET /v1/models lists it with its base as `parent`.
A bad folder or name is 400 naming it; unloading an unknown adapter is 404."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from mesh.clients.router_pool import Routers
from services.edge.config import EdgeConfig
from services.edge.errors import ApiError, from_grpc, shown
from services.edge.surfaces.fields import parse_json
from services.edge.transports.asgi import Receive, Scope, Send, read_body, send_json

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
PATHS = (LOAD, UNLOAD)
FIELDS = {LOAD: ("lora_name", "lora_path", "model", "replica"), UNLOAD: ("lora_name", "lora_int_id")}


class LoraApi:
    def __init__(self, config: EdgeConfig, router: Routers, changed: Callable[[], None]):
        self.config, self.router = config, router
        self.changed = changed          # the response cache reads the model list again

    async def load(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        body, name = await self._body(LOAD, headers, receive)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "lora_path: give the adapter's PEFT folder (a string) on the engines' machines",
                           "lora_path", code="missing_required_parameter")
        model, replica = body.get("model", ""), body.get("replica", "")
        if not isinstance(model, str) or not isinstance(replica, str):
            raise ApiError(400, "model and replica are strings", "model" if not isinstance(model, str) else "replica")
        try:
            cards = await self.router.load_lora_adapter(name, path, model, replica)
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        self.changed()
        card = next(c for c in cards if c.name == name)
        await send_json(send, 200, {"object": "lora_adapter", **card.as_dict(),
                                    "message": f"Success: LoRA adapter '{name}' added successfully."})
        return 200

    async def unload(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        _, name = await self._body(UNLOAD, headers, receive)
        try:
            await self.router.unload_lora_adapter(name)
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        self.changed()
        await send_json(send, 200, {"object": "lora_adapter", "lora_name": name, "unloaded": True,
                                    "message": f"Success: LoRA adapter '{name}' removed successfully."})
        return 200

    async def _body(self, path: str, headers: dict[str, str], receive: Receive) -> tuple[dict[str, Any], str]:
        """The request's JSON object and its lora_name (400 for an unknown field or a missing name)."""
        body = parse_json(await read_body(receive, headers, self.config.max_body_bytes, self.config.body_timeout_s))
        unknown = sorted(set(body) - set(FIELDS[path]))
        if unknown:
            raise ApiError(400, f"unrecognized field(s): {shown(', '.join(unknown))}; use "
                           f"{', '.join(FIELDS[path])}", unknown[0], code="unknown_parameter")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "lora_name: give the adapter's name (a string), which requests then use as their "
                           "model", "lora_name", code="missing_required_parameter")
        return body, name
