"""bench/soak.py's requests: one coroutine per kind of traffic, each request's answer checked against its
fault-free reference and classified (completed, error:<retryable cause>, lost:<why>).

Every request goes as one of TENANTS (API keys of the keys file, tiers of different weights: the engines'
fair scheduling shares their steps between them); the reference of a prompt does not depend on the tenant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
import httpx

from mesh.clients.http3 import H3Client
from mesh.clients.router_client import GenerateSpec, Message, Sampling
from mesh.clients.router_pool import RouterPool

MODEL = "smollm2-135m"
LORA = "soak-lora"                   # the adapter bench/soak.py loads at start
PROMPTS = [f"Write two sentences about {t}." for t in (
    "the sea", "a fox", "winter", "a violin", "the moon", "bread", "a river", "glaciers", "a market", "comets",
    "lighthouses", "owls", "rain", "a library", "bicycles", "tea")]
SESSIONS = [("My name is Ada and I like {x}.", "What do I like?", "Say my name."),
            ("I live near {x}.", "Where do I live?", "Describe it in three words.")]
CHAINS = [("My favourite colour is {x}. Tell me something about it.", "What is my favourite colour?"),
          ("I have a pet called {x}. Greet it.", "What is my pet called?")]
TOPICS = ("mountains", "the coast", "a forest", "the desert")
NAMES = ("green", "blue", "Rex", "Tom")
RETRYABLE_HTTP = {429, 503}
RETRYABLE_CODES = {"429", "503", "unavailable", "resource_exhausted"}
RETRYABLE_GRPC = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


class Tenant(NamedTuple):
    name: str
    key: str
    tier: str
    weight: float


TENANTS = (Tenant("alpha", "soak-key-alpha", "free", 1), Tenant("beta", "soak-key-beta", "standard", 2),
           Tenant("gamma", "soak-key-gamma", "premium", 3))


@dataclass
class Outcome:
    kind: str
    start: float
    end: float
    result: str                  # completed | error:<what> | lost:<why>
    tenant: str = ""
    during_fault: bool = False


class _Failed(Exception):
    """A request that ended without its text: str() is `error:...` (retryable) or `lost:...`."""


def bearer(tenant: Tenant) -> dict[str, str]:
    return {"authorization": f"Bearer {tenant.key}"}


@dataclass
class Soak:
    a: argparse.Namespace
    http: str
    h3_port: int
    routers: list[str]
    references: dict[tuple[str, ...], str] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)
    pool: RouterPool | None = None

    # -- one request per transport: its text, or raise _Failed ------------------------------
    def body(self, messages: list[dict[str, str]], stream: bool, model: str = MODEL) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": self.a.max_tokens,
                                "temperature": 0, "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def http1(self, client: httpx.AsyncClient, tenant: Tenant, messages: list[dict[str, str]], stream: bool,
                    headers: dict[str, str] | None = None, model: str = MODEL) -> str:
        url, headers = f"{self.http}/v1/chat/completions", {**bearer(tenant), **(headers or {})}
        if not stream:
            reply = await client.post(url, json=self.body(messages, False, model), headers=headers)
            if reply.status_code != 200:
                _check_status(reply.status_code, reply.text, reply.headers)
            choice = reply.json()["choices"][0]
            _check_finish(choice["finish_reason"])
            return str(choice["message"]["content"])
        async with client.stream("POST", url, json=self.body(messages, True, model), headers=headers) as reply:
            if reply.status_code != 200:
                _check_status(reply.status_code, (await reply.aread()).decode(), reply.headers)
            return _sse([line async for line in reply.aiter_lines()])

    async def http3(self, tenant: Tenant, messages: list[dict[str, str]]) -> str:
        payload = json.dumps(self.body(messages, True)).encode()
        headers = {"content-type": "application/json", **bearer(tenant)}
        async with H3Client("127.0.0.1", self.h3_port, verify=False, timeout=self.a.request_timeout) as c, \
                c.stream("POST", "/v1/chat/completions", headers, payload) as s:
            raw = b"".join([chunk async for chunk in s.chunks()]).decode()
            if s.status != 200:
                _check_status(s.status, raw, s.headers)
            return _sse(raw.splitlines())

    async def native(self, tenant: Tenant, prompt: str) -> str:
        assert self.pool is not None
        spec = GenerateSpec(model=MODEL, messages=(Message("user", prompt),),
                            request_id=f"soak-{random.getrandbits(48):x}",
                            sampling=Sampling(temperature=0, max_tokens=self.a.max_tokens, ignore_eos=True))
        text, finish = [], None
        try:
            async for d in self.pool.generate(spec, timeout=self.a.request_timeout,
                                              extra_metadata=[("authorization", f"Bearer {tenant.key}")]):
                text.append(d.text)
                finish = d.finish_reason or finish
        except grpc.aio.AioRpcError as err:
            if err.code() in RETRYABLE_GRPC:
                raise _Failed(f"error:{err.code().name} {_cause(err.details() or '')}") from None
            raise _Failed(f"lost:grpc {err.code().name}: {err.details()}") from None
        _check_finish(finish)
        return "".join(text)

    async def responses(self, client: httpx.AsyncClient, tenant: Tenant, text: str, stream: bool,
                        store: bool = False, previous: str = "") -> tuple[str, str]:
        """POST /v1/responses, whole or streamed: (the answer's text, the response's id)."""
        body: dict[str, Any] = {"model": MODEL, "input": text, "max_output_tokens": self.a.max_tokens,
                                "temperature": 0, "stream": stream, "store": store}
        if previous:
            body["previous_response_id"] = previous
        url = f"{self.http}/v1/responses"
        if not stream:
            reply = await client.post(url, json=body, headers=bearer(tenant))
            if reply.status_code != 200:
                _check_status(reply.status_code, reply.text, reply.headers)
            data = reply.json()
            return _response_text(data), str(data["id"])
        async with client.stream("POST", url, json=body, headers=bearer(tenant)) as reply:
            if reply.status_code != 200:
                _check_status(reply.status_code, (await reply.aread()).decode(), reply.headers)
            return _response_events([line async for line in reply.aiter_lines()])

    # -- the traffic -----------------------------------------------------------------------
    def call(self, client: httpx.AsyncClient, kind: str, prompt: str, tenant: Tenant, stream: bool = False) -> Any:
        """The coroutine function that sends `prompt` one way (`stream`: the adapter's chat, streamed or not)."""
        messages = [{"role": "user", "content": prompt}]

        async def response(stream: bool) -> str:
            return (await self.responses(client, tenant, prompt, stream))[0]

        return {"http1-stream": lambda: self.http1(client, tenant, messages, True),
                "http1": lambda: self.http1(client, tenant, messages, False),
                "http3-stream": lambda: self.http3(tenant, messages),
                "grpc": lambda: self.native(tenant, prompt),
                "responses": lambda: response(False),
                "responses-stream": lambda: response(True),
                "lora": lambda: self.http1(client, tenant, messages, stream, model=LORA)}[kind]

    @staticmethod
    def key(kind: str, prompt: str) -> tuple[str, ...]:
        """A prompt's reference: chat's over every transport, the Responses API's and the adapter's apart."""
        return ("responses", prompt) if kind.startswith("responses") else ("lora", prompt) if kind == "lora" \
            else (prompt,)

    async def one(self, client: httpx.AsyncClient, kind: str, rng: random.Random) -> None:
        tenant = rng.choice(TENANTS)
        if kind == "session":
            await self.session(client, tenant, rng.choice(SESSIONS), rng.choice(TOPICS), rng.getrandbits(64))
        elif kind == "responses-chain":
            await self.chain(client, tenant, rng.choice(CHAINS), rng.choice(NAMES), rng)
        else:
            prompt = rng.choice(PROMPTS)
            call = self.call(client, kind, prompt, tenant, rng.random() < 0.5)
            await self.measure(kind, call, self.key(kind, prompt), tenant)

    async def session(self, client: httpx.AsyncClient, tenant: Tenant, script: tuple[str, ...], topic: str,
                      tag: int) -> None:
        """Three turns, each sending only its new message (x-session-id): the router keeps the rest."""
        sid = f"soak-{tag:x}"
        turns = [t.format(x=topic) for t in script]
        for k, turn in enumerate(turns):
            messages = [{"role": "user", "content": turn}]

            async def send(messages: list[dict[str, str]] = messages, stream: bool = k % 2 == 0) -> str:
                return await self.http1(client, tenant, messages, stream, {"x-session-id": sid})

            if not await self.measure("session", send, tuple(turns[:k + 1]), tenant):
                return          # an error ends the session (a client would retry the turn; we count it)

    async def chain(self, client: httpx.AsyncClient, tenant: Tenant, script: tuple[str, str], name: str,
                    rng: random.Random) -> None:
        """Two Responses turns: the first stored, the second continuing it by previous_response_id."""
        first, second = (t.format(x=name) for t in script)
        rid = ""

        async def turn(text: str, stream: bool, store: bool, previous: str) -> str:
            nonlocal rid
            answer, rid = await self.responses(client, tenant, text, stream, store, previous)
            return answer

        if await self.measure("responses-chain", lambda: turn(first, rng.random() < 0.5, True, ""),
                              ("chain", first), tenant):
            await self.measure("responses-chain", lambda: turn(second, rng.random() < 0.5, False, rid),
                               ("chain", first, second), tenant)

    async def measure(self, kind: str, call: Any, key: tuple[str, ...], tenant: Tenant) -> bool:
        start = time.monotonic()
        try:
            text = await asyncio.wait_for(call(), self.a.request_timeout)
            result = "completed" if text == self.references.get(key, text) else \
                f"lost:text differs ({len(text)} vs {len(self.references[key])} chars)"
            if key not in self.references:
                self.references[key] = text
        except _Failed as exc:
            result = str(exc)
        except TimeoutError:
            result = "lost:hung"
        except (httpx.HTTPError, OSError, ConnectionError) as exc:
            result = f"lost:{type(exc).__name__}: {exc}"
        self.outcomes.append(Outcome(kind, start, time.monotonic(), result, tenant.name))
        return result == "completed"


CAUSES = (("session store", "session store unreachable"), ("no replica", "no engine replica free"),
          ("budget", "no engine replica free"), ("tokenizer", "tokenizer replicas down"),
          ("every router", "every router down"), ("engine", "engine failed"), ("object store", "object store"),
          ("cache service", "cache service unreachable"))


def _cause(message: str) -> str:
    """A short name for why a retryable error came (the message names the part that failed)."""
    return next((name for key, name in CAUSES if key in message), f"other: {message[:80]}")


def _check_status(status: int, text: str, headers: Any) -> None:
    try:
        message = str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = text
    if status in RETRYABLE_HTTP:
        hint = "" if headers.get("retry-after") else ", no Retry-After"
        raise _Failed(f"error:{status} {_cause(message)}{hint}")
    raise _Failed(f"lost:http {status}: {message[:200]}")


def _check_finish(finish: str | None) -> None:
    if finish != "length":
        raise _Failed(f"lost:finish {finish}")


def _stream_error(err: dict[str, Any]) -> _Failed:
    """An error event: retryable when it names a retryable status (the HTTP one, or the router's gRPC code)."""
    code = str(err.get("code") or err.get("type") or "")
    message = str(err.get("message"))
    return _Failed(f"error:{code} {_cause(message)} (mid-stream)" if code in RETRYABLE_CODES else
                   f"lost:stream {code}: {message[:120]}")


def _sse(lines: list[str]) -> str:
    """The streamed chat text; an error event is a retryable error when it names a retryable cause."""
    text, finish = [], None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise _stream_error(event["error"])
        for choice in event.get("choices") or ():
            text.append(choice.get("delta", {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    _check_finish(finish)
    return "".join(text)


def _response_text(data: dict[str, Any]) -> str:
    """A response object's text; it must have ended (completed, or incomplete at the token limit)."""
    status = data.get("status")
    reason = (data.get("incomplete_details") or {}).get("reason")
    if status != "completed" and not (status == "incomplete" and reason == "max_output_tokens"):
        raise _Failed(f"lost:response {status} ({reason})")
    return "".join(part.get("text", "") for item in data.get("output") or () if item.get("type") == "message"
                   for part in item.get("content") or () if part.get("type") == "output_text")


def _response_events(lines: list[str]) -> tuple[str, str]:
    """The Responses API's events: the deltas must add up to the final response's text."""
    deltas, final = [], None
    for line in lines:
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        kind = event.get("type")
        if kind == "error":
            raise _stream_error(event)
        if kind == "response.output_text.delta":
            deltas.append(event["delta"])
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            final = event["response"]
    if final is None:
        raise _Failed("lost:stream ended without its final event")
    text = _response_text(final)
    if "".join(deltas) != text:
        raise _Failed(f"lost:deltas ({len(''.join(deltas))} chars) differ from the final text ({len(text)})")
    return text, str(final["id"])
