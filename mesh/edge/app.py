"""The edge's ASGI application: one app behind both HTTP/1.1 and HTTP/3.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions,
GET|PUT /admin/models/{model}/routing (admin keys only),
GET /metrics.  Bad requests are answered here, in OpenAI's error shape, and never reach
the router.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import grpc
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from mesh.client import Delta, GenerateSpec, RouterClient
from mesh.edge import openai
from mesh.edge.auth import ApiKeys
from mesh.edge.config import EdgeConfig
from mesh.edge.openai import BadRequest
from mesh.errors import http_status
from mesh.telemetry import headers_context, tracer

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

REQUESTS = Counter("infermesh_edge_requests_total", "HTTP requests by route and status", ["route", "status"])
TTFT = Histogram("infermesh_edge_time_to_first_token_seconds", "Time to the first text delta",
                 buckets=(0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8))
DURATION = Histogram("infermesh_edge_request_duration_seconds", "Completion request duration",
                     buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120))
COMPLETION_TOKENS = Counter("infermesh_edge_completion_tokens_total", "Completion tokens returned")

ADMIN_PREFIX = "/admin/models/"
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class EdgeApp:
    def __init__(self, config: EdgeConfig, router: RouterClient):
        self.config = config
        self.router = router
        self.keys = ApiKeys(config.api_key_digests)
        self.admin_keys = ApiKeys(config.admin_key_digests)
        self._health_cache: tuple[float, bool] = (0.0, False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        method, path = scope["method"], scope["path"]
        route = {
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): self.models,
            ("GET", "/metrics"): self.metrics,
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/completions"): self.completions,
        }.get((method, path))
        admin = path.startswith(ADMIN_PREFIX)
        if admin and method in ("GET", "PUT"):
            route = self.admin
        status = 500
        started = False

        async def tracked_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            if route is None:
                known = path in ("/health", "/v1/models", "/metrics", "/v1/chat/completions", "/v1/completions")
                if known or admin:
                    raise BadRequest(f"method {method} is not allowed on {path}", status=405,
                                     code="method_not_allowed")
                raise BadRequest(f"no route {method} {path}", status=404, kind="not_found_error", code=None)
            if admin:
                self.check_admin(headers)
            elif path not in ("/health", "/metrics") and not self.keys.check(headers.get("authorization", "")):
                raise BadRequest("invalid or missing API key (send 'Authorization: Bearer KEY')", status=401,
                                 kind="authentication_error", code="invalid_api_key")
            status = await route(scope, headers, receive, tracked_send)
        except BadRequest as exc:
            status = exc.status
            if not started:
                await send_json(tracked_send, exc.status, openai.error_body(exc.message, exc.kind, exc.code, exc.param),
                                exc.retry_after_s)
        except Exception:
            log.exception("%s %s failed", method, path)
            if not started:
                await send_json(tracked_send, 500, openai.error_body("internal error", "server_error", None))
        finally:
            REQUESTS.labels("/admin" if admin else path if route else "other", str(status)).inc()

    # -- simple routes -----------------------------------------------------------------
    async def health(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        checked_at, ok = self._health_cache
        if time.monotonic() - checked_at > 0.5:
            ok = await self.router.healthy()
            self._health_cache = (time.monotonic(), ok)
        status = 200 if ok else 503
        await send_json(send, status, {"status": "ok" if ok else "unavailable"})
        return status

    async def models(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        try:
            cards = await self.router.models()
        except grpc.aio.AioRpcError as err:
            raise _grpc_bad_request(err) from None
        data = [{"id": c.name, "object": "model", "created": 0, "owned_by": "infermesh",
                 "version": c.version, "versions": list(c.versions), "replicas": c.replicas,
                 "max_context": c.max_context} for c in cards]
        await send_json(send, 200, {"object": "list", "data": data})
        return 200

    async def metrics(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())]})
        await send({"type": "http.response.body", "body": generate_latest()})
        return 200

    # -- admin: model versions ---------------------------------------------------------
    def check_admin(self, headers: dict[str, str]) -> None:
        if not self.admin_keys.enabled:
            raise BadRequest("the admin API is off: configure admin keys (INFERMESH_ADMIN_KEYS or "
                             "INFERMESH_ADMIN_KEYS_FILE); API keys do not open it", status=403,
                             kind="permission_error", code="admin_disabled")
        if not self.admin_keys.check(headers.get("authorization", "")):
            raise BadRequest("invalid or missing admin key (send 'Authorization: Bearer ADMIN_KEY')", status=401,
                             kind="authentication_error", code="invalid_admin_key")

    async def admin(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        """GET|PUT /admin/models/{model}/routing: the default version and canary shares.

        PUT body: {"default_version": "2"} and/or {"canary": {"3": 0.1}} (replaces the shares;
        {} ends a canary).  Requests already streaming finish on the version they started on."""
        model, _, tail = scope["path"][len(ADMIN_PREFIX):].partition("/")
        if not model or tail != "routing":
            raise BadRequest(f"no admin route {scope['path']}; use {ADMIN_PREFIX}MODEL/routing", status=404,
                             kind="not_found_error", code=None)
        try:
            if scope["method"] == "GET":
                routing = await self.router.model_routing(model)
            else:
                default, canary = openai.parse_model_routing(await self.read_json(receive, headers))
                routing = await self.router.set_model_routing(model, default, canary)
        except grpc.aio.AioRpcError as err:
            raise _grpc_bad_request(err) from None
        await send_json(send, 200, routing.as_dict())
        return 200

    # -- completions -------------------------------------------------------------------
    async def chat(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        body = await self.read_json(receive, headers)
        spec = openai.parse_chat(body, headers.get("x-session-id", ""), headers.get("x-infermesh-replica", ""))
        return await self.complete(True, body, spec, headers, receive, send)

    async def completions(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        body = await self.read_json(receive, headers)
        spec = openai.parse_completion(body, headers.get("x-session-id", ""),
                                       headers.get("x-infermesh-replica", ""))
        return await self.complete(False, body, spec, headers, receive, send)

    async def read_json(self, receive: Receive, headers: dict[str, str]) -> dict[str, Any]:
        limit = self.config.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"request body is larger than {limit} bytes", status=413, code="body_too_large")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("client disconnected", status=499, code=None)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"request body is larger than {limit} bytes", status=413, code="body_too_large")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        try:
            body = json.loads(b"".join(chunks).decode("utf-8"))
        except UnicodeDecodeError:
            raise BadRequest("request body is not valid UTF-8", code="invalid_encoding") from None
        except json.JSONDecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object", code="invalid_type")
        return body

    async def complete(self, chat: bool, body: dict[str, Any], spec: GenerateSpec, headers: dict[str, str],
                       receive: Receive, send: Send) -> int:
        stream, include_usage = openai.stream_options(body)
        rid = openai.new_id(chat)
        spec = dataclasses.replace(spec, request_id=rid,
                                   model_version=headers.get("x-infermesh-model-version", "").strip())
        parent = headers_context(headers)
        with tracer().start_as_current_span("edge.request", context=parent, kind=trace.SpanKind.SERVER,
                                            attributes={"request_id": rid, "stream": stream}):
            deltas = self.router.generate(spec, timeout=self.config.request_timeout_s)
            if stream:
                return await self._stream(chat, rid, deltas, include_usage, receive, send)
            return await self._whole(chat, rid, deltas, send)

    async def _whole(self, chat: bool, rid: str, deltas: AsyncIterator[Delta], send: Send) -> int:
        started = time.monotonic()
        parts: list[str] = []
        final: Delta | None = None
        try:
            async for d in deltas:
                parts.append(d.text)
                if d.finish_reason is not None:
                    final = d
        except grpc.aio.AioRpcError as err:
            raise _grpc_bad_request(err) from None
        if final is None:
            raise BadRequest("the stream ended without a final message", status=502, kind="server_error", code=None)
        DURATION.observe(time.monotonic() - started)
        COMPLETION_TOKENS.inc(final.completion_tokens)
        model = final.served_by.model if final.served_by else ""
        await send_json(send, 200, openai.completion_body(chat, rid, model, "".join(parts), final))
        return 200

    async def _stream(self, chat: bool, rid: str, deltas: AsyncIterator[Delta],
                      include_usage: bool, receive: Receive, send: Send) -> int:
        started = time.monotonic()
        # Pull the first delta before answering, so an early error is still a proper 4xx/5xx.
        try:
            first = await anext(deltas)
        except grpc.aio.AioRpcError as err:
            raise _grpc_bad_request(err) from None
        except StopAsyncIteration:
            raise BadRequest("the stream ended without a final message", status=502, kind="server_error",
                             code=None) from None
        TTFT.observe(time.monotonic() - started)
        model = first.served_by.model if first.served_by else ""
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        relay = asyncio.ensure_future(self._relay(chat, rid, model, first, deltas, include_usage, send))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        done, _ = await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        if relay not in done:
            relay.cancel()  # the client left: cancelling the gRPC call aborts the engine's work
            await asyncio.gather(relay, return_exceptions=True)
            return 499
        gone.cancel()
        relay.result()
        DURATION.observe(time.monotonic() - started)
        return 200

    async def _relay(self, chat: bool, rid: str, model: str, first: Delta, deltas: AsyncIterator[Delta],
                     include_usage: bool, send: Send) -> None:
        async def emit(obj: dict[str, Any]) -> None:
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(obj).encode() + b"\n\n",
                        "more_body": True})

        d: Delta | None = first
        is_first = True
        try:
            while d is not None:
                if d.finish_reason is not None:
                    if d.text:
                        await emit(openai.chunk_body(chat, rid, model, d.text, first=is_first))
                    await emit(openai.chunk_body(chat, rid, model, "", d.finish_reason, final=d))
                    if include_usage:
                        await emit(openai.usage_chunk(chat, rid, model, d))
                    COMPLETION_TOKENS.inc(d.completion_tokens)
                    break
                if d.text or is_first:
                    await emit(openai.chunk_body(chat, rid, model, d.text, first=is_first))
                    is_first = False
                d = await anext(deltas, None)
        except grpc.aio.AioRpcError as err:
            status, kind = http_status(err.code())
            await emit(openai.error_body(err.details() or "generation failed", kind, status))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _grpc_bad_request(err: grpc.aio.AioRpcError) -> BadRequest:
    status, kind = http_status(err.code())
    retry_after = 0
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after" and str(value).isdigit():
            retry_after = int(value)
    if status in (429, 503) and not retry_after:
        retry_after = 1
    return BadRequest(err.details() or err.code().name, status=status, kind=kind, code=err.code().name.lower(),
                      retry_after_s=retry_after)


async def send_json(send: Send, status: int, obj: dict[str, Any], retry_after_s: int = 0) -> None:
    body = json.dumps(obj).encode()
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    if retry_after_s > 0:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
