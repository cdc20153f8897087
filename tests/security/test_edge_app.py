"""Issue 16, the edge's app: echoed values, session headers, failed-key limits (ASGI, no sockets)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from mesh.apikeys import digest
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from services.edge.errors import from_grpc
from tests.fakes.edge_router import CHAT, CHAT_JSON, FakeRouter, asgi

KEY = {"authorization": "Bearer k1"}
LONG = "z" * 10_000


def _app(**config: Any) -> EdgeApp:
    return EdgeApp(EdgeConfig(api_key_digests=(digest("k1"),), **config), FakeRouter())  # type: ignore[arg-type]


def _error(body: bytes) -> dict[str, Any]:
    return json.loads(body)["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("method,path,body", [
    (LONG, "/v1/models", b""),                                                      # the method
    ("GET", "/" + LONG, b""),                                                       # the path
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, "seed": int("9" * 4000)}).encode()),
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, LONG: 1}).encode()),      # an unknown field
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, **{f"{LONG}{i}": 1 for i in range(50)}}).encode()),
    ("POST", "/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": LONG, "content": "x"}]}).encode()),
])
def test_values_echoed_in_errors_are_cut_short(method: str, path: str, body: bytes) -> None:
    status, _, reply = asyncio.run(asgi(_app(), method, path, body, KEY))
    error = _error(reply)
    assert status in (400, 404, 405) and len(error["message"]) < 400, error["message"][:200]
    assert error["param"] is None or len(error["param"]) <= 67


def test_router_messages_relayed_in_errors_are_cut_short() -> None:
    err = grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               f"replica {LONG} is not serving")
    assert len(from_grpc(err).message) <= 515


@pytest.mark.parametrize("header,limit", [("x-session-id", 256), ("x-infermesh-replica", 256),
                                          ("x-infermesh-model-version", 64)])
def test_an_over_long_session_or_routing_header_is_a_400_naming_it(header: str, limit: int) -> None:
    app = _app()
    status, _, reply = asyncio.run(asgi(app, "POST", "/v1/chat/completions", CHAT_JSON,
                                        {**KEY, header: "s" * (limit + 1)}))
    assert status == 400 and _error(reply)["param"] == header
    assert app.router.calls == []               # type: ignore[attr-defined]
    status, _, _ = asyncio.run(asgi(app, "POST", "/v1/chat/completions", CHAT_JSON, {**KEY, header: "s" * limit}))
    assert status == 200


async def _raw(app: EdgeApp, headers: list[tuple[bytes, bytes]], client: str = "10.0.0.1"
               ) -> tuple[int, dict[str, str], dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    bodies = [CHAT_JSON]

    async def receive() -> dict[str, Any]:
        if not bodies:
            await asyncio.Event().wait()        # the client stays connected
        return {"type": "http.request", "body": bodies.pop(), "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers,
             "client": (client, 4000)}
    await app(scope, receive, send)
    return (sent[0]["status"], {k.decode(): v.decode() for k, v in sent[0]["headers"]},
            _error(b"".join(m.get("body", b"") for m in sent[1:])) if sent[0]["status"] != 200 else {})


def test_two_authorization_headers_are_refused_not_last_wins() -> None:
    app = _app()
    for pair in ([b"Bearer nope", b"Bearer k1"], [b"Bearer k1", b"Bearer k1"]):
        status, _, error = asyncio.run(_raw(app, [(b"authorization", v) for v in pair]))
        assert status == 400 and error["code"] == "duplicate_header" and error["param"] == "authorization"
    status, _, error = asyncio.run(_raw(app, [(b"x-session-id", b"a"), (b"x-session-id", b"b"), *_key()]))
    assert status == 400 and error["param"] == "x-session-id"
    assert app.router.calls == []               # type: ignore[attr-defined]


def _key(key: bytes = b"k1") -> list[tuple[bytes, bytes]]:
    return [(b"authorization", b"Bearer " + key)]


def test_failed_keys_are_limited_per_client_address() -> None:
    async def main() -> None:
        app = _app()                    # the default: 10 failed keys a minute per address
        for _ in range(10):
            assert (await _raw(app, _key(b"guess")))[0] == 401
        status, headers, error = await _raw(app, _key(b"guess"))
        assert status == 429 and int(headers["retry-after"]) >= 1 and error["type"] == "auth_failures"
        status, _, _ = await _raw(app, _key())      # the right key too: guessing must not tell it apart
        assert status == 429
        assert (await _raw(app, _key(), client="10.0.0.2"))[0] == 200    # other addresses are not slowed
        for _ in range(20):                                              # nor are good keys counted
            assert (await _raw(app, _key(), client="10.0.0.3"))[0] == 200

    asyncio.run(main())


def test_the_admin_api_counts_failed_keys_too() -> None:
    app = EdgeApp(EdgeConfig(admin_key_digests=(digest("adm"),)), FakeRouter())  # type: ignore[arg-type]
    statuses = [asyncio.run(asgi(app, "GET", "/admin/models/m/routing", b"", {"authorization": "Bearer x"}))[0]
                for _ in range(11)]
    assert statuses == [401] * 10 + [429]
