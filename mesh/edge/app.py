"""The edge's ASGI application: one app behind both HTTP/1.1 and HTTP/3.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions,
GET|PUT /admin/models/{model}/routing (admin keys only), GET /metrics, GET /openapi.json.
Bad requests are answered here, in OpenAI's error shape, and never reach the router.

Admission, in order: API key (401), request rate per caller (429), body size (413) and read time
(408), parsing (400), requests in flight across all callers (503), token rate per caller (429);
only then the router.  Slow request heads are cut off by the HTTP/1.1 protocol (mesh/edge/__main__.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, MutableMapping
from typing import Any

import grpc
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from mesh.client import Delta, GenerateSpec, RouterClient, TokenLogprob
from mesh.edge import openai, openapi
from mesh.edge.auth import ApiKeys
from mesh.edge.config import EdgeConfig
from mesh.edge.openai import BadRequest, LogprobFormatter
from mesh.edge.ratelimit import InFlight, Limiter, estimate_tokens, retry_after_s
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
REFUSED = Counter("infermesh_edge_refused_total", "Requests refused by the edge's limits", ["limit"])

ADMIN_PREFIX = "/admin/models/"
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
PUBLIC = ("/health", "/metrics", "/openapi.json")      # no API key needed
ROUTES = ("/health", "/v1/models", "/metrics", "/openapi.json", "/v1/chat/completions", "/v1/completions")


@dataclasses.dataclass
class _Charge:
    """One request's token reservation, settled when it ends."""

    caller: Hashable
    reserved: int
    started: bool = False           # a delta arrived: the router may have generated tokens
    used: int | None = None         # prompt + completion tokens, once the final message told


class EdgeApp:
    def __init__(self, config: EdgeConfig, router: RouterClient):
        self.config = config
        self.router = router
        self.keys = ApiKeys(config.api_key_digests)
        self.admin_keys = ApiKeys(config.admin_key_digests)
        self.request_limit = Limiter(config.rate_limit) if config.rate_limit else None
        self.token_limit = Limiter(config.token_limit) if config.token_limit else None
        self.in_flight = InFlight(config.max_concurrent)
        self.openapi = json.dumps(openapi.document(config)).encode()
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
            ("GET", "/openapi.json"): self.openapi_json,
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
                if path in ROUTES or admin:
                    raise BadRequest(f"method {method} is not allowed on {path}", status=405,
                                     code="method_not_allowed")
                raise BadRequest(f"no route {method} {path}", status=404, kind="not_found_error", code=None)
            if admin:
                self.check_admin(headers)
            elif path not in PUBLIC:
                scope["infermesh.caller"] = caller = self.authenticate(scope, headers)
                self.limit_requests(caller)
            status = await route(scope, headers, receive, tracked_send)
        except BadRequest as exc:
            status = exc.status
            if not started:
                await send_json(tracked_send, exc.status, openai.error_body(exc.message, exc.kind, exc.code, exc.param),
                                exc.retry_after_s, exc.close)
        except Exception:
            log.exception("%s %s failed", method, path)
            if not started:
                await send_json(tracked_send, 500, openai.error_body("internal error", "server_error", None))
        finally:
            REQUESTS.labels("/admin" if admin else path if route else "other", str(status)).inc()

    # -- admission -----------------------------------------------------------------------
    def authenticate(self, scope: Scope, headers: dict[str, str]) -> Hashable:
        """The caller that rate limits count against: its API key's digest, or with no keys configured
        (loopback only) its address."""
        if not self.keys.enabled:
            client = scope.get("client")
            return client[0] if client else "unknown"
        caller = self.keys.match(headers.get("authorization", ""))
        if caller is None:
            raise BadRequest("invalid or missing API key (send 'Authorization: Bearer KEY')", status=401,
                             kind="authentication_error", code="invalid_api_key")
        return caller

    def limit_requests(self, caller: Hashable) -> None:
        if self.request_limit is None:
            return
        wait = self.request_limit.take(caller, 1, time.monotonic())
        if wait > 0:
            REFUSED.labels("requests").inc()
            raise BadRequest(f"Rate limit reached for requests: limit {self.request_limit.rate}. "
                             f"Please try again in {wait:.3g}s.", status=429, kind="requests",
                             code="rate_limit_exceeded", retry_after_s=retry_after_s(wait))

    def reserve_tokens(self, caller: Hashable, spec: GenerateSpec) -> _Charge:
        text_bytes = (len(spec.prompt.encode()) if spec.prompt is not None else
                      sum(len(m.content.encode()) for m in spec.messages))
        charge = _Charge(caller, estimate_tokens(text_bytes, spec.sampling.max_tokens))
        if self.token_limit is not None:
            limit = self.token_limit
            wait = limit.take(caller, charge.reserved, time.monotonic())
            if wait > 0:
                REFUSED.labels("tokens").inc()
                raise BadRequest(f"Rate limit reached for tokens: limit {limit.rate}, requested about "
                                 f"{charge.reserved} (prompt estimate + max_tokens). Please try again in "
                                 f"{wait:.3g}s.", status=429, kind="tokens", code="rate_limit_exceeded",
                                 retry_after_s=retry_after_s(wait))
        return charge

    def settle_tokens(self, charge: _Charge) -> None:
        """Refund what was reserved but not used; an overrun becomes the caller's debt.  A request that
        ended before any token (refused by the router) costs nothing; one cut off mid-stream keeps its
        reservation, since its usage is unknown."""
        if self.token_limit is None:
            return
        if charge.used is not None:
            self.token_limit.give(charge.caller, charge.reserved - charge.used, time.monotonic())
        elif not charge.started:
            self.token_limit.give(charge.caller, charge.reserved, time.monotonic())

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

    async def openapi_json(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*JSON_HEADERS, (b"content-length", str(len(self.openapi)).encode())]})
        await send({"type": "http.response.body", "body": self.openapi})
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
        spec = openai.parse_chat(body, headers.get("x-session-id", ""), headers.get("x-infermesh-replica", ""),
                                 self.config.max_messages)
        return await self.complete(True, body, spec, scope, headers, receive, send)

    async def completions(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        body = await self.read_json(receive, headers)
        spec = openai.parse_completion(body, headers.get("x-session-id", ""),
                                       headers.get("x-infermesh-replica", ""))
        return await self.complete(False, body, spec, scope, headers, receive, send)

    async def read_body(self, receive: Receive, headers: dict[str, str]) -> bytes:
        """The whole body, at most max_body_bytes (413, refused on Content-Length before reading), read
        within body_timeout_s (408: a client trickling its body must not hold the request open)."""
        limit = self.config.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"request body is larger than {limit} bytes", status=413, code="body_too_large")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise BadRequest(f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                                 status=408, code="request_timeout", close=True) from None
            if message["type"] == "http.disconnect":
                raise BadRequest("client disconnected", status=499, code=None)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"request body is larger than {limit} bytes", status=413, code="body_too_large")
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def read_json(self, receive: Receive, headers: dict[str, str]) -> dict[str, Any]:
        return openai.parse_json(await self.read_body(receive, headers))

    async def complete(self, chat: bool, body: dict[str, Any], spec: GenerateSpec, scope: Scope,
                       headers: dict[str, str], receive: Receive, send: Send) -> int:
        stream, include_usage = openai.stream_options(body)
        if not self.in_flight.enter():
            REFUSED.labels("in_flight").inc()
            raise BadRequest(f"the edge is at its limit of {self.in_flight.limit} requests in flight; "
                             "retry shortly", status=503, kind="service_unavailable", code="overloaded",
                             retry_after_s=1)
        try:
            charge = self.reserve_tokens(scope.get("infermesh.caller", ""), spec)
        except BadRequest:
            self.in_flight.leave()
            raise
        rid = openai.new_id(chat)
        spec = dataclasses.replace(spec, request_id=rid,
                                   model_version=headers.get("x-infermesh-model-version", "").strip())
        lp = LogprobFormatter(chat, len(spec.prompt or "")) if spec.sampling.logprobs else None
        parent = headers_context(headers)
        try:
            with tracer().start_as_current_span("edge.request", context=parent, kind=trace.SpanKind.SERVER,
                                                attributes={"request_id": rid, "stream": stream}):
                deltas = self.router.generate(spec, timeout=self.config.request_timeout_s)
                if stream:
                    return await self._stream(chat, rid, deltas, include_usage, lp, charge, receive, send)
                return await self._whole(chat, rid, deltas, lp, charge, send)
        finally:
            self.in_flight.leave()
            self.settle_tokens(charge)

    async def _whole(self, chat: bool, rid: str, deltas: AsyncIterator[Delta], lp: LogprobFormatter | None,
                     charge: _Charge, send: Send) -> int:
        started = time.monotonic()
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        final: Delta | None = None
        try:
            async for d in deltas:
                charge.started = True
                parts.append(d.text)
                logprobs.extend(d.logprobs)
                if d.finish_reason is not None:
                    final = d
        except grpc.aio.AioRpcError as err:
            raise _grpc_bad_request(err) from None
        if final is None:
            raise BadRequest("the stream ended without a final message", status=502, kind="server_error", code=None)
        charge.used = final.prompt_tokens + final.completion_tokens
        DURATION.observe(time.monotonic() - started)
        COMPLETION_TOKENS.inc(final.completion_tokens)
        model = final.served_by.model if final.served_by else ""
        await send_json(send, 200, openai.completion_body(chat, rid, model, "".join(parts), final,
                                                          lp.format(logprobs) if lp else None))
        return 200

    async def _stream(self, chat: bool, rid: str, deltas: AsyncIterator[Delta], include_usage: bool,
                      lp: LogprobFormatter | None, charge: _Charge, receive: Receive, send: Send) -> int:
        started = time.monotonic()
        # Pull the first delta before answering, so an early error is still a proper 4xx/5xx.
        try:
            first = await anext(deltas)
            charge.started = True
        except grpc.aio.AioRpcError as err:
            raise _grpc_bad_request(err) from None
        except StopAsyncIteration:
            raise BadRequest("the stream ended without a final message", status=502, kind="server_error",
                             code=None) from None
        TTFT.observe(time.monotonic() - started)
        model = first.served_by.model if first.served_by else ""
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        relay = asyncio.ensure_future(self._relay(chat, rid, model, first, deltas, include_usage, lp, charge, send))
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
                     include_usage: bool, lp: LogprobFormatter | None, charge: _Charge, send: Send) -> None:
        async def emit(obj: dict[str, Any]) -> None:
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(obj).encode() + b"\n\n",
                        "more_body": True})

        d: Delta | None = first
        is_first = True
        try:
            while d is not None:
                # A delta's logprobs ride on its text chunk (the stop matcher may hold text back, so a
                # chunk can carry tokens and no text yet).
                logprobs = lp.format(d.logprobs) if lp and d.logprobs else None
                if d.text or is_first or logprobs:
                    await emit(openai.chunk_body(chat, rid, model, d.text, first=is_first, logprobs=logprobs))
                    is_first = False
                if d.finish_reason is not None:
                    charge.used = d.prompt_tokens + d.completion_tokens
                    await emit(openai.chunk_body(chat, rid, model, "", d.finish_reason, final=d))
                    if include_usage:
                        await emit(openai.usage_chunk(chat, rid, model, d))
                    COMPLETION_TOKENS.inc(d.completion_tokens)
                    break
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


async def send_json(send: Send, status: int, obj: dict[str, Any], retry_after_s: int = 0,
                    close: bool = False) -> None:
    body = json.dumps(obj).encode()
    headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    if retry_after_s > 0:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
