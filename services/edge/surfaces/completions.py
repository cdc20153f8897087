"""POST /v1/chat/completions and /v1/completions: parse, then the edge's pipeline (services/edge/gateway/pipeline.py:
screen, stamp, admit, guarded answers, store), the response cache, and the answer whole or as SSE.

A request reaches the router only once it parsed (400), found a place in flight (503) and its
tokens (429).  Streaming answers pull the first delta before the 200, so an error the router
reports at once is still a proper 4xx/5xx; later errors arrive as an `error` event before
`[DONE]`.  A client that goes away, streaming or not, cancels the gRPC call, which aborts the
engine's work; its in-flight place is given back at once.  Each request names its caller to the
router as a tenant (`tenant`), which keeps one caller's sessions from every other's, and carries its
tier's priority and KV-cache eviction class (services/edge/gateway/tenants.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace

from mesh.clients.router_client import Delta, GenerateSpec
from mesh.clients.router_pool import Routers
from mesh.errors import http_status
from mesh.telemetry import headers_context, tracer
from services.edge.config import EdgeConfig
from services.edge.errors import ApiError, error_body, from_grpc
from services.edge.gateway.admission import Charge
from services.edge.gateway.pipeline import Guarded, Pipeline, drain, guarded
from services.edge.gateway.response_cache import (
    Entry,
    ResponseCache,
    ServedVersions,
    blocked_by,
    bypassed,
    cache_key,
    storable,
)
from services.edge.gateway.tenants import AuthenticatedCaller
from services.edge.metrics import COMPLETION_TOKENS, DURATION, RESPONSE_CACHE, SLOW_READERS, TTFT
from services.edge.surfaces import choices, requests, responses
from services.edge.surfaces.choices import Choice, Piece
from services.edge.transports.asgi import JSON_HEADERS, Receive, Scope, Send, send_json, unless_gone, wait_disconnect

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


@dataclass(frozen=True)
class CompletionHop:
    """What answering one request carries from the router's deltas to the client: chat or completions, the
    response id, the fanned-out deltas through the choices' guards (pipeline.guarded), each choice's answer, `n`,
    whether a stream ends with a usage chunk (stream_options.include_usage), and the caller's admission charge
    (its usage settled)."""
    chat: bool
    rid: str
    deltas: Guarded
    answers: list[Choice]
    n: int
    include_usage: bool
    charge: Charge
    stored: GenerateSpec | None = None      # a session's turn the edge stores (choices.store_turn), as released


class Completions:
    def __init__(self, config: EdgeConfig, router: Routers, pipe: Pipeline):
        self.config, self.router, self.pipe = config, router, pipe
        self.cache = ResponseCache(config.response_cache_ttl_s, config.response_cache_bytes,
                                   ServedVersions(lambda: router.models()), config.cache_service)

    async def close(self) -> None:
        await self.cache.close()
        await self.pipe.close()

    async def chat(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        body = await self.pipe.read_json(scope, receive, headers)
        spec = requests.parse_chat(body, headers.get("x-session-id", ""), headers.get("x-infermesh-replica", ""),
                                 self.config.max_messages)
        return await self.complete(True, body, spec, scope, headers, receive, send)

    async def completions(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        body = await self.pipe.read_json(scope, receive, headers)
        spec = requests.parse_completion(body, headers.get("x-session-id", ""),
                                       headers.get("x-infermesh-replica", ""))
        return await self.complete(False, body, spec, scope, headers, receive, send)

    async def complete(self, chat: bool, body: dict[str, Any], spec: GenerateSpec, scope: Scope,
                       headers: dict[str, str], receive: Receive, send: Send) -> int:
        stream, include_usage = requests.stream_options(body)
        caller: AuthenticatedCaller = scope["infermesh.caller"]
        policy = await self.pipe.screen(body, caller)
        pinned = headers.get("x-infermesh-model-version", "").strip()
        key = cache_key(chat, caller.tenant, body, spec, pinned) if self.cache.enabled else None
        if key is not None:
            if bypassed(headers):
                RESPONSE_CACHE.labels("bypass").inc()
            else:
                entry = await self.cache.get(key, pinned)
                if entry is not None and not blocked_by(policy, entry):
                    return await _replay(chat, entry, stream, include_usage, scope, send)
        rid = responses.new_id(chat)
        # Under output rules a session's turn is stored as it went out, by the edge (the router's would be raw).
        spec = self.pipe.stamp(spec, caller, headers, rid,
                               caller_stores_turn=bool(chat and spec.session_id and policy.output))
        with self.pipe.admitted(caller, spec) as charge:
            answers, deltas = self.pipe.answers(chat, spec, policy)
            with tracer().start_as_current_span("edge.request", context=headers_context(headers),
                                                kind=trace.SpanKind.SERVER, attributes={
                                                    "request_id": rid, "stream": stream, "choices": len(answers)}):
                hop = CompletionHop(chat, rid, guarded(deltas, answers, charge), answers, spec.n, include_usage,
                                    charge, spec if spec.caller_stores_turn else None)
                whole = None
                if stream:
                    status = await self._stream(hop, receive, send)
                else:
                    status, whole = await self._whole(hop, receive, send)
                # Never cached: an answer cut by the rules, or one whose top_logprobs lost an alternative.
                if key is not None and status == 200 and all(a.final is not None and not a.blocked
                                                             and not a.filtered for a in answers):
                    whole = whole or _whole_body(chat, rid, answers, choices.usage(answers, spec.n))
                    if storable(whole):
                        self.cache.put(key, Entry(whole, whole["model"], (whole["infermesh"] or {}).get(
                            "model_version", "")))
                return status

    async def _whole(self, hop: CompletionHop, receive: Receive, send: Send) -> tuple[int, dict[str, Any] | None]:
        """The status and the answer sent (None when the client left)."""
        answers, charge, started = hop.answers, hop.charge, time.monotonic()
        # The client may leave while the answer is collected, with no write to notice it by:
        # watch for its disconnect, or an abandoned request would run to max_tokens.
        if await unless_gone(_collect(hop.deltas, answers), receive) is None:
            return 499, None
        if hop.stored is not None:
            await choices.store_turn(self.router, hop.stored, answers[0])
        use = choices.usage(answers, hop.n)
        charge.used = use["total_tokens"]
        DURATION.observe(time.monotonic() - started)
        COMPLETION_TOKENS.inc(use["completion_tokens"])
        body = _whole_body(hop.chat, hop.rid, answers, use)
        await send_json(send, 200, body)
        return 200, body

    async def _stream(self, hop: CompletionHop, receive: Receive, send: Send) -> int:
        started = time.monotonic()
        # Pull the first delta before answering, so an early error is still a proper 4xx/5xx.
        try:
            first = await anext(hop.deltas)
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        except StopAsyncIteration:
            raise ApiError(502, "the stream ended without a final message", kind="server_error",
                           code=None) from None
        TTFT.observe(time.monotonic() - started)
        d = first[1]
        model = d.served_by.model if d.served_by else ""
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        relay = asyncio.ensure_future(self._relay(hop, model, first, send))
        gone = asyncio.ensure_future(wait_disconnect(receive))
        done, _ = await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        if relay not in done:
            relay.cancel()  # the client left: cancelling the gRPC calls aborts the engines' work
            await asyncio.gather(relay, return_exceptions=True)
            return 499
        gone.cancel()
        relay.result()
        DURATION.observe(time.monotonic() - started)
        return 200

    async def _relay(self, hop: CompletionHop, model: str, first: tuple[int, Delta, list[Piece]], send: Send
                     ) -> None:
        async def emit(obj: dict[str, Any]) -> None:
            # A client that does not take a chunk in time (its transport buffer full) is cut off: waiting
            # for it would hold an engine slot, and edge memory, for as long as it cares to read.
            message = {"type": "http.response.body", "body": b"data: " + json.dumps(obj).encode() + b"\n\n",
                       "more_body": True}
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the cancellation that a
            # client's disconnect sends (when the send completes in the same instant), and this stream
            # would then go on, unread, for as long as the generation does.
            try:
                async with asyncio.timeout(self.config.stream_send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise SlowReader from None

        try:
            await self._relay_deltas(hop, model, first, emit)
        except SlowReader:
            SLOW_READERS.inc()
            await _last_words(send, error_body(
                f"the client did not accept the stream's data within {self.config.stream_send_timeout_s:g} s "
                "(--stream-send-timeout); the generation was stopped", "invalid_request_error", "slow_reader"))
            await hop.deltas.aclose()        # ends the router calls now: the engines stop generating
            return
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _relay_deltas(self, hop: CompletionHop, model: str, item: tuple[int, Delta, list[Piece]] | None,
                            emit: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Each choice's chunks as its deltas come, then the usage chunk; a router error as an error event
        (emit raises SlowReader for a client that does not take a chunk in time, error event included)."""
        chat, deltas, answers, head = hop.chat, hop.deltas, hop.answers, responses.StreamHead(hop.chat, hop.rid, model)
        try:
            while item is not None:
                index, d, pieces = item
                answer = answers[index]
                logprobs = answer.stream_logprobs(d)
                if not chat and answer.echo and not answer.started:
                    answer.started = True
                    await emit(responses.chunk_body(head, answer.echo, index=index,
                                                    logprobs=answer.echo_logprobs()))
                # A delta's logprobs ride on its text chunk (the stop matcher may hold text back, so a
                # chunk can carry tokens and no text yet).
                if pieces or logprobs or answer.new_reasoning or not answer.started:
                    await emit(responses.chunk_body(head, "".join(p for p in pieces if isinstance(p, str)),
                                                    logprobs=logprobs, index=index,
                                                    delta=answer.delta(pieces) if chat else None))
                    answer.started = True
                if answer.final is not None:        # (a choice the rules blocked too: pipeline.guarded stopped it)
                    answer.cut = True
                    if hop.stored is not None:
                        await choices.store_turn(self.router, hop.stored, answer)
                    await emit(responses.chunk_body(head, "", answer.finish_reason, final=answer.final,
                                                    index=index))
                item = await anext(deltas, None)
            use = choices.usage(answers, hop.n)
            hop.charge.used = use["total_tokens"]
            if hop.include_usage:
                await emit(responses.usage_chunk(head, use, choices.meta(answers)))
            COMPLETION_TOKENS.inc(use["completion_tokens"])
        except grpc.aio.AioRpcError as err:
            status, kind = http_status(err.code())
            await emit(error_body(err.details() or "generation failed", kind, status))
        except ApiError as exc:                 # the turn not stored (choices.store_turn)
            await emit(exc.body())


def _whole_body(chat: bool, rid: str, answers: list[Choice], use: dict[str, Any]) -> dict[str, Any]:
    return responses.whole_body(chat, rid, _model(answers), [a.body() for a in answers], use, choices.meta(answers))


async def _replay(chat: bool, entry: Entry, stream: bool, include_usage: bool, scope: Scope, send: Send) -> int:
    """A cached answer, whole or as a stream, marked `infermesh.cached` and with the edge's time in
    Server-Timing (from the request's arrival)."""
    body = {**entry.body, "id": responses.new_id(chat), "created": int(time.time()),
            "infermesh": {**(entry.body.get("infermesh") or {}), "cached": True}}
    if stream:
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n"
                        for c in responses.replay_chunks(chat, body, include_usage)) + b"data: [DONE]\n\n"
        head = SSE_HEADERS
    else:
        data = json.dumps(body).encode()
        head = [*JSON_HEADERS, (b"content-length", str(len(data)).encode())]
    spent_ms = (time.perf_counter() - scope.get("infermesh.t0", time.perf_counter())) * 1000
    await send({"type": "http.response.start", "status": 200, "headers": [
        *head, (b"x-infermesh-cache", b"hit"), (b"server-timing", f"edge;dur={spent_ms:.3f}".encode())]})
    await send({"type": "http.response.body", "body": data})
    return 200


class SlowReader(Exception):
    """The client did not accept a stream's chunk within --stream-send-timeout."""


async def _last_words(send: Send, error: dict[str, Any]) -> None:
    """The error event and the stream's end, if the client takes them within a second; else nothing."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.0):
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(error).encode() + b"\n\n"
                        + b"data: [DONE]\n\n", "more_body": False})


def _model(answers: list[Choice]) -> str:
    final = answers[0].final
    return final.served_by.model if final is not None and final.served_by else ""


async def _collect(deltas: Guarded, answers: list[Choice]) -> bool:
    """Every choice's whole answer (its guards ran: pipeline.guarded)."""
    try:
        await drain(deltas)
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err) from None
    if any(a.final is None for a in answers):
        raise ApiError(502, "the stream ended without a final message", kind="server_error", code=None)
    return True
