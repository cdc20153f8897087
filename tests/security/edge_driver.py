"""The edge's ASGI app driven in-process, with a router double that records what reaches it.

The client side is scripted: the request body, then (when asked) an `http.disconnect`, the
event uvicorn (HTTP/1.1) and services/edge/transports/http3.py (a reset or closed stream) both deliver.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from mesh.clients.router_client import Delta, GenerateSpec, ServedBy
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig

SERVED = ServedBy("engine-0", "m", "1", "local", False, 1.0)


class SlowRouter:
    """A router client: one delta every `every_s` seconds for `tokens` deltas (then the final one);
    it notes each call's spec and whether the call was cancelled."""

    def __init__(self, tokens: int = 1_000_000, every_s: float = 0.01):
        self.tokens, self.every_s = tokens, every_s
        self.calls: list[GenerateSpec] = []
        self.cancelled = 0
        self.started = asyncio.Event()

    async def generate(self, spec: GenerateSpec, timeout: float | None = None) -> AsyncIterator[Delta]:
        self.calls.append(spec)
        self.started.set()
        try:
            for _ in range(self.tokens):
                yield Delta("t ")
                await asyncio.sleep(self.every_s)
            yield Delta("", "length", 3, self.tokens, served_by=SERVED)
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1          # what a gRPC call's cancellation looks like to its consumer
            raise


def edge(router: SlowRouter, **config: Any) -> EdgeApp:
    return EdgeApp(EdgeConfig(**config), router)  # type: ignore[arg-type]


class Client:
    """One request to the app; `leave()` makes the client disconnect."""

    def __init__(self, app: EdgeApp, path: str, body: bytes, headers: dict[str, str] | None = None):
        self.app = app
        self.scope = {"type": "http", "method": "POST", "path": path, "client": ("127.0.0.1", 5000),
                      "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
        self.body = body
        self.sent: list[dict[str, Any]] = []
        self._gone = asyncio.Event()
        self._delivered = False

    async def receive(self) -> dict[str, Any]:
        if not self._delivered:
            self._delivered = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def leave(self) -> None:
        self._gone.set()

    async def run(self) -> None:
        await self.app(self.scope, self.receive, self.send)

    @property
    def status(self) -> int | None:
        return self.sent[0]["status"] if self.sent else None
