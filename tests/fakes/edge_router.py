"""The edge's ASGI app over a router double, without a network: what tests/unit/test_openai.py, the edge's
other unit tests and tests/security drive the edge with.

`FakeRouter` counts what reaches it and answers with canned deltas, or blocks until released; `edge_app`
builds the edge over it; `asgi` sends one request through the app and returns (status, headers, body);
`CHAT` and `CHAT_JSON` are a minimal chat completion request (a dict, and the body with max_tokens 4).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from mesh.chat import Message
from mesh.clients.router_client import Delta, GenerateSpec, ServedBy
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig

CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}
CHAT_JSON = json.dumps({**CHAT, "max_tokens": 4}).encode()


class FakeRouter:
    """Counts what reaches it; answers with canned deltas, or blocks until released."""

    def __init__(self, deltas: list[Delta] | None = None):
        self.calls: list[GenerateSpec] = []
        served = ServedBy("engine-0", "m", "1", "local", False, 1.0)
        self.deltas = deltas or [Delta("Hi"), Delta("!", "stop", 7, 2, served_by=served)]
        self.release: asyncio.Event | None = None
        self.turns: list[tuple[GenerateSpec, Message]] = []     # store_turn's (the edge stores what it released)

    address = "127.0.0.1:1"

    async def healthy(self) -> bool:
        return True

    async def state(self) -> dict[str, Any]:
        return {"ready": True, "tokenizer": "serving", "expected_engines": 1, "load_entropy": 1.0,
                "engines": [{"replica": "engine-0", "healthy": True, "breaker": "closed"}]}

    async def generate(self, spec: GenerateSpec, timeout: float | None = None) -> AsyncIterator[Delta]:
        self.calls.append(spec)
        if self.release is not None:
            await self.release.wait()
        for d in self.deltas:
            yield d

    async def store_turn(self, spec: GenerateSpec, answer: Message, timeout: float = 10.0) -> None:
        self.turns.append((spec, answer))


async def asgi(app: EdgeApp, method: str, path: str, body: bytes | None = b"", headers: dict[str, str] | None = None,
               ) -> tuple[int, dict[str, str], bytes]:
    """One request; body None sends nothing and never finishes (a stalled client)."""
    hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    path, _, query = path.partition("?")
    scope = {"type": "http", "method": method, "path": path, "headers": hdrs, "client": ("127.0.0.1", 5000),
             "query_string": query.encode()}
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if body is None or delivered:
            await asyncio.Event().wait()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in sent[1:]))


def edge_app(router: FakeRouter | None = None, **config: Any) -> EdgeApp:
    return EdgeApp(EdgeConfig(**config), router or FakeRouter())  # type: ignore[arg-type]
