"""POST /v1/responses (OpenAI's Responses API), whole or streamed as its typed server-sent events.

A request runs as one chat completion (services/edge/surfaces/responses_input.py makes it one): the same admission,
content rules, tool calls and structured outputs.  With `store` (the default) the conversation, this answer
included, is kept in the cache service's session store under the response's id, namespaced by the caller's
tenant as sessions are (the router stores it: RouterGenerateRequest.session_id); `previous_response_id`
continues one (history_from), on any router and after a restart of the cache service, as sessions do.

Streamed events: response.created, response.in_progress, then per output item response.output_item.added,
for a message response.content_part.added, response.output_text.delta ..., response.output_text.done,
response.content_part.done, for a function call response.function_call_arguments.delta and .done, then
response.output_item.done; last response.completed (or response.incomplete at max_output_tokens), each with
its sequence_number.  An error after the stream began is an `error` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from mesh import tools
from mesh.clients.router_client import Delta, GenerateSpec
from mesh.clients.router_pool import Routers
from mesh.tool_stream import CallFragment
from services.edge.config import EdgeConfig
from services.edge.errors import ApiError, error_body, from_grpc
from services.edge.gateway.pipeline import Deltas, Pipeline, guarded
from services.edge.object_store import StoredObjects
from services.edge.surfaces import requests
from services.edge.surfaces.choices import Choice, store_turn
from services.edge.surfaces.responses_input import ResponsesRequest, parse_responses
from services.edge.transports.asgi import Receive, Scope, Send, send_json, unless_gone

log = logging.getLogger(__name__)

PREFIX = "/v1/responses/"
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
Emit = Callable[[str, dict[str, Any]], Awaitable[None]]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class Output:
    """The response object being built, item by item, and the events that tell a stream about it."""

    def __init__(self, rid: str, model: str, request: ResponsesRequest, emit: Emit):
        self.rid, self.model, self.request, self.emit = rid, model, request, emit
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None       # the message item being written
        self.written: list[str] = []                       # its text so far
        self.open_call: dict[str, Any] | None = None       # the function_call item whose arguments stream
        self.reasoning: dict[str, Any] | None = None       # the reasoning item being written
        self.thoughts: list[str] = []                      # its text so far
        self.final: Delta | None = None

    def body(self, status: str) -> dict[str, Any]:
        final = self.final
        usage = None if final is None else {
            "input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "input_tokens_details": {"cached_tokens": final.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}
        # Incomplete: cut by the output rules (the choice's final says so), or at max_output_tokens.
        cut = final is not None and final.finish_reason == "content_filter"
        incomplete = {"reason": "content_filter" if cut else "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": list(self.items), "usage": usage, "error": None,
                "incomplete_details": incomplete, **self.request.echo}

    async def thought(self, piece: str) -> None:
        """A piece of a reasoning model's thoughts (its reasoning item opens with the first)."""
        if self.reasoning is None:
            self.reasoning = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                              "status": "in_progress"}
            await self.emit("response.output_item.added", {"output_index": len(self.items), "item": self.reasoning})
        self.thoughts.append(piece)
        await self.emit("response.reasoning_text.delta", {"item_id": self.reasoning["id"],
                                                          "output_index": len(self.items), "content_index": 0,
                                                          "delta": piece})

    async def close_reasoning(self) -> None:
        if self.reasoning is None:
            return
        item, self.reasoning = self.reasoning, None
        text, self.thoughts = "".join(self.thoughts), []
        item.update(status="completed", content=[{"type": "reasoning_text", "text": text}])
        index = len(self.items)
        await self.emit("response.reasoning_text.done", {"item_id": item["id"], "output_index": index,
                                                         "content_index": 0, "text": text})
        await self.emit("response.output_item.done", {"output_index": index, "item": item})
        self.items.append(item)

    async def text(self, piece: str) -> None:
        await self.close_reasoning()
        if self.message is None:
            self.message = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                            "content": []}
            await self.emit("response.output_item.added", {"output_index": len(self.items), "item": self.message})
            await self.emit("response.content_part.added", {**self._where(), "part": _part("")})
        self.written.append(piece)
        await self.emit("response.output_text.delta", {**self._where(), "delta": piece})

    async def close_message(self) -> None:
        await self.close_reasoning()
        if self.message is None:
            return
        item, self.message = self.message, None
        text, self.written = "".join(self.written), []
        item.update(status="completed", content=[_part(text)])
        where = {"item_id": item["id"], "output_index": len(self.items), "content_index": 0}
        await self.emit("response.output_text.done", {**where, "text": text})
        await self.emit("response.content_part.done", {**where, "part": _part(text)})
        await self.emit("response.output_item.done", {"output_index": len(self.items), "item": item})
        self.items.append(item)

    async def call_piece(self, piece: CallFragment) -> None:
        """A piece of a call's arguments as the model writes them (its item opens with the first)."""
        if piece.first:
            await self.close_message()
            self.open_call = {"type": "function_call", "id": new_id("fc"), "call_id": piece.id, "name": piece.name,
                              "arguments": "", "status": "in_progress"}
            await self.emit("response.output_item.added", {"output_index": len(self.items),
                                                           "item": dict(self.open_call)})
        if self.open_call is not None:
            await self.emit("response.function_call_arguments.delta",
                            {"item_id": self.open_call["id"], "output_index": len(self.items),
                             "delta": piece.arguments})

    async def call(self, call: tools.ToolCall) -> None:
        """A whole call: the end of the one streamed in pieces, or one read whole (its arguments in one delta)."""
        item, self.open_call = self.open_call, None
        index = len(self.items)
        if item is None or item["call_id"] != call.id:
            await self.close_message()
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
                    "arguments": "", "status": "in_progress"}
            await self.emit("response.output_item.added", {"output_index": index, "item": dict(item)})
            await self.emit("response.function_call_arguments.delta",
                            {"item_id": item["id"], "output_index": index, "delta": call.arguments})
        await self.emit("response.function_call_arguments.done",
                        {"item_id": item["id"], "output_index": index, "arguments": call.arguments})
        item.update(arguments=call.arguments, status="completed")
        await self.emit("response.output_item.done", {"output_index": index, "item": item})
        self.items.append(item)

    def _where(self) -> dict[str, Any]:
        assert self.message is not None
        return {"item_id": self.message["id"], "output_index": len(self.items), "content_index": 0}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


class Responses:
    """The route's handler (app.py routes it; the caller is admitted by then)."""

    def __init__(self, config: EdgeConfig, router: Routers, pipe: Pipeline, stored: StoredObjects):
        self.config, self.router, self.pipe = config, router, pipe
        self.stored = stored        # stored responses, for GET (services/edge/object_store.py)

    async def stored_response(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        """GET /v1/responses/{id}: a stored response as it was answered; DELETE: it and its conversation (a
        previous_response_id naming it is then a 404 too).  Another tenant's ids are not found."""
        rid = scope["path"].removeprefix(PREFIX)
        tenant = scope["infermesh.caller"].tenant
        if not rid or "/" in rid or len(rid) > 128:
            raise ApiError(404, f"no route {scope['method']} {scope['path'][:80]}", kind="not_found_error", code=None)
        if scope["method"] == "GET":
            value = await self.stored.get(tenant, "response", rid)
            if value is None:
                raise ApiError(404, f"Response with id '{rid}' not found.", kind="not_found_error", code=None)
            await send_json(send, 200, json.loads(value))
            return 200
        try:
            forgotten = await self.router.forget_conversation(rid, tenant)
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        if not (await self.stored.delete(tenant, "response", rid) or forgotten):
            raise ApiError(404, f"Response with id '{rid}' not found.", kind="not_found_error", code=None)
        await send_json(send, 200, {"id": rid, "object": "response", "deleted": True})
        return 200

    async def create(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        request = parse_responses(await self.pipe.read_json(scope, receive, headers))
        caller = scope["infermesh.caller"]
        policy = await self.pipe.screen(request.chat, caller)
        rid = new_id("resp")
        spec = self.pipe.stamp(requests.parse_chat(request.chat, max_messages=self.config.max_messages), caller,
                               headers, rid, session_id=rid if request.store else "", history_from=request.previous,
                               caller_stores_turn=request.store)
        with self.pipe.admitted(caller, spec) as charge:
            (choice,), deltas = self.pipe.answers(True, spec, policy)
            if request.stream:
                return await self._stream(request, spec, deltas, choice, charge, receive, send)
            output = Output(rid, spec.model, request, _silent)
            done = await unless_gone(self._run(deltas, choice, output, charge), receive)
            if done is None:
                return 499
            await send_json(send, 200, await self._ended(request, spec, choice, output, done))
            return 200

    async def _ended(self, request: ResponsesRequest, spec: GenerateSpec, choice: Choice, output: Output,
                     status: str) -> dict[str, Any]:
        """The response as it ended; with `store`, its turn stored as it went out and the response kept for GET."""
        body = output.body(status)
        if request.store:
            await store_turn(self.router, spec, choice)
            await self._keep(spec.tenant, spec.request_id, body)
        return body

    async def _keep(self, tenant: str, rid: str, body: dict[str, Any]) -> None:
        """Store the response for GET; a store that refuses (full, unreachable) costs the caller only that: the
        answer still goes out (its conversation is in the session store either way)."""
        try:
            await self.stored.put(tenant, "response", rid, json.dumps(body).encode())
        except ApiError as exc:
            log.warning("response %s not kept for GET /v1/responses/%s: %s", rid, rid, exc.message)

    async def _run(self, deltas: Deltas, choice: Choice, output: Output, charge: Any) -> str:
        """Relay the answer into `output` through the choice's guards (a choice the output rules block is stopped
        there: pipeline.guarded); its final status (completed, incomplete)."""
        try:
            async for _, delta, pieces in guarded(deltas, [choice], charge):
                output.model = delta.served_by.model if delta.served_by else output.model
                if choice.new_reasoning and not choice.blocked:
                    await output.thought(choice.new_reasoning)
                for piece in pieces:
                    if isinstance(piece, tools.ToolCall):
                        await output.call(piece)
                    elif isinstance(piece, CallFragment):
                        await output.call_piece(piece)
                    elif piece:
                        await output.text(piece)
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        await output.close_message()
        output.final = choice.final
        if choice.final is not None:
            charge.used = choice.final.prompt_tokens + choice.final.completion_tokens
        return "incomplete" if choice.finish_reason in ("length", "content_filter") else "completed"

    async def _stream(self, request: ResponsesRequest, spec: GenerateSpec, deltas: Deltas, choice: Choice, charge: Any,
                      receive: Receive, send: Send) -> int:
        sequence = 0

        async def emit(kind: str, fields: dict[str, Any]) -> None:
            nonlocal sequence
            event = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode()})

        output = Output(spec.request_id, spec.model, request, emit)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        await emit("response.created", {"response": output.body("in_progress")})
        await emit("response.in_progress", {"response": output.body("in_progress")})
        try:
            done = await unless_gone(self._run(deltas, choice, output, charge), receive)
            if done is None:
                return 499
            await emit(f"response.{done}", {"response": await self._ended(request, spec, choice, output, done)})
        except ApiError as exc:
            await emit("error", {"code": exc.code, "message": exc.message, "param": exc.param})
        except asyncio.CancelledError:
            raise
        except Exception:        # noqa: BLE001 - the stream is open: the client learns of it in an event
            await emit("error", error_body("internal error", "server_error", None)["error"])
        await send({"type": "http.response.body", "body": b""})
        return 200


async def _silent(kind: str, fields: dict[str, Any]) -> None:
    """A whole answer's events: none."""
