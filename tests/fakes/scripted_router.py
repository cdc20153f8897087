"""The edge's ASGI app with a router double that answers with scripted deltas, and one-call requests.

The router double answers every call with the same deltas (token by token, with logprobs when the
test gives them), counts the calls that reach it, and lists models with the versions a test sets.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from mesh.chat import Message
from mesh.clients.router_client import Delta, GenerateSpec, ModelCard, ServedBy, TokenLogprob, TopLogprob
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from tests.fakes.edge_router import asgi


def tokens(pieces: Sequence[str], alternatives: dict[int, Sequence[str]] | None = None,
           finish: str = "stop", version: str = "1") -> list[Delta]:
    """One delta a token, each with its logprob entry (ids 100, 101, ...); alternatives[k] are token k's
    runners-up (ids 900, 901, ...); the last delta carries the finish and who served it (`version`)."""
    served = ServedBy("engine-0", "m", version, "local", False, 1.0)
    out = []
    for k, piece in enumerate(pieces):
        top = [TopLogprob(100 + k, piece, -0.1)] + [TopLogprob(900 + j, alt, -2.0 - j)
                                                     for j, alt in enumerate((alternatives or {}).get(k, ()))]
        entry = TokenLogprob(100 + k, piece, -0.1, tuple(top))
        last = k == len(pieces) - 1
        out.append(Delta(piece, finish if last else None, 5 if last else 0, len(pieces) if last else 0,
                         served_by=served if last else None, ids=(100 + k,), logprobs=(entry,)))
    return out


class ScriptedRouter:
    address = "127.0.0.1:1"

    def __init__(self, deltas: list[Delta], versions: tuple[str, ...] = ("1",)):
        self.deltas = deltas
        self.calls: list[GenerateSpec] = []
        self.versions = versions
        self.turns: list[tuple[GenerateSpec, Message]] = []     # store_turn's (the edge stores what it released)
        self.sent = 0                                           # deltas yielded, over every call

    async def healthy(self) -> bool:
        return True

    async def state(self) -> dict[str, Any]:
        return {"ready": True, "tokenizer": "serving", "expected_engines": 1, "load_entropy": 1.0,
                "engines": [{"replica": "engine-0", "healthy": True}]}

    async def models(self) -> list[ModelCard]:
        return [ModelCard("m", "1", 1, 2048, self.versions)]

    async def generate(self, spec: GenerateSpec, timeout: float | None = None) -> AsyncIterator[Delta]:
        self.calls.append(spec)
        for d in self.deltas:
            self.sent += 1
            yield d
            await asyncio.sleep(0)

    async def store_turn(self, spec: GenerateSpec, answer: Message, timeout: float = 10.0) -> None:
        self.turns.append((spec, answer))


def app(router: ScriptedRouter, **config: Any) -> EdgeApp:
    return EdgeApp(EdgeConfig(**config), router)  # type: ignore[arg-type]


async def request(edge: EdgeApp, method: str, path: str, body: dict[str, Any] | bytes | None = None,
                  headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body bytes) of one request; a dict body is sent as JSON."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
    return await asgi(edge, method, path, raw, headers)


def events(raw: bytes) -> list[dict[str, Any]]:
    """A stream's JSON events, without [DONE]."""
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]
