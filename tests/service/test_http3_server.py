"""HTTP/3 edge server + client over real QUIC on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest

from mesh.clients.http3 import H3Client
from services.edge.transports.http3 import serve_http3
from services.edge.transports.tls import ensure_self_signed_cert

SSE_CHUNKS = 5
SSE_GAP = 0.05


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return ensure_self_signed_cert(str(tmp_path_factory.mktemp("tls")))


async def read_body(receive: Callable) -> bytes:
    """An ASGI request's whole body."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


class App:
    """Tiny ASGI app covering the shapes the edge serves: JSON, SSE, failures."""

    def __init__(self) -> None:
        self.disconnected = asyncio.Event()

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable, send: Callable) -> None:
        assert scope["type"] == "http"
        body = await read_body(receive)
        path = scope["path"]
        if path == "/boom":
            raise RuntimeError("app bug")
        if path == "/sse":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for i in range(SSE_CHUNKS):
                chunk = f"data: {i}\n\n".encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await asyncio.sleep(SSE_GAP)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if path == "/forever":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            watcher = asyncio.create_task(receive())
            while not watcher.done():
                await send({"type": "http.response.body", "body": b"tick", "more_body": True})
                await asyncio.sleep(0.02)
            assert watcher.result()["type"] == "http.disconnect"
            self.disconnected.set()
            # Sends after a disconnect must be ignored, not raise.
            await send({"type": "http.response.body", "body": b"late", "more_body": False})
            return
        payload = {
            "method": scope["method"], "path": path, "query": scope["query_string"].decode(),
            "http_version": scope["http_version"], "scheme": scope["scheme"],
            "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
            "client": list(scope["client"]), "body": body.decode(),
        }
        data = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"x-echo", b"yes")]})
        await send({"type": "http.response.body", "body": data})


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_with_server(cert: tuple[str, str], check: Callable[[int, Any], Awaitable[None]], app: Any = None,
                    **server_options: Any) -> None:
    """Serve `app` (default: App()) over HTTP/3 on a free loopback port while `check(port, app)` runs."""
    async def main() -> None:
        served = App() if app is None else app
        port = _free_udp_port()
        server = await serve_http3(served, "127.0.0.1", port, *cert, **server_options)
        try:
            async with asyncio.timeout(20):
                await check(port, served)
        finally:
            server.close()

    asyncio.run(main())


def test_get_returns_status_headers_body(cert: tuple[str, str]) -> None:
    async def check(port: int, app: App) -> None:
        async with H3Client("127.0.0.1", port, verify=False) as c:
            r = await c.request("GET", "/echo/a%20b?x=1", headers={"X-Trace": "t1"})
        assert r.status == 200
        assert r.headers["content-type"] == "application/json"
        assert r.headers["x-echo"] == "yes"
        got = json.loads(r.body)
        assert got["method"] == "GET" and got["path"] == "/echo/a b" and got["query"] == "x=1"
        assert got["http_version"] == "3" and got["scheme"] == "https"
        assert got["headers"]["x-trace"] == "t1"
        assert got["headers"]["host"] == f"127.0.0.1:{port}"
        assert got["client"][0] == "127.0.0.1" and got["client"][1] > 0

    run_with_server(cert, check)


def test_post_body_reaches_app(cert: tuple[str, str]) -> None:
    async def check(port: int, app: App) -> None:
        body = json.dumps({"prompt": "x" * 5000}).encode()  # spans several QUIC packets
        async with H3Client("127.0.0.1", port, verify=False) as c:
            r = await c.request("POST", "/echo", headers={"content-type": "application/json"}, body=body)
        assert r.status == 200
        assert json.loads(r.body)["body"] == body.decode()

    run_with_server(cert, check)


def test_sse_chunks_arrive_separately_in_order(cert: tuple[str, str]) -> None:
    async def check(port: int, app: App) -> None:
        async with H3Client("127.0.0.1", port, verify=False) as c, c.stream("GET", "/sse") as s:
            assert s.status == 200 and s.headers["content-type"] == "text/event-stream"
            arrivals: list[tuple[float, bytes]] = []
            async for chunk in s.chunks():
                arrivals.append((time.monotonic(), chunk))
        assert [c for _, c in arrivals] == [f"data: {i}\n\n".encode() for i in range(SSE_CHUNKS)]
        # Flushed per chunk, not buffered until the end of the response.
        assert arrivals[-1][0] - arrivals[0][0] >= (SSE_CHUNKS - 1) * SSE_GAP * 0.8

    run_with_server(cert, check)


def test_app_exception_gives_500_and_server_survives(cert: tuple[str, str]) -> None:
    async def check(port: int, app: App) -> None:
        async with H3Client("127.0.0.1", port, verify=False) as c:
            r = await c.request("GET", "/boom")
            assert r.status == 500
            err = {"message": "internal error", "type": "server_error", "code": 500}
            assert json.loads(r.body) == {"error": err}
            assert (await c.request("GET", "/echo")).status == 200
        async with H3Client("127.0.0.1", port, verify=False) as c:
            assert (await c.request("GET", "/echo")).status == 200

    run_with_server(cert, check)


def test_client_closing_mid_stream(cert: tuple[str, str]) -> None:
    async def check(port: int, app: App) -> None:
        # Whole connection goes away mid-stream.
        async with H3Client("127.0.0.1", port, verify=False) as c, c.stream("GET", "/forever") as s:
            async for _ in s.chunks():
                break
        await asyncio.wait_for(app.disconnected.wait(), 5)
        app.disconnected.clear()
        # Only the stream is abandoned (STOP_SENDING); the connection keeps serving.
        async with H3Client("127.0.0.1", port, verify=False) as c:
            async with c.stream("GET", "/forever") as s:
                async for _ in s.chunks():
                    break
            await asyncio.wait_for(app.disconnected.wait(), 5)
            assert (await c.request("GET", "/echo")).status == 200

    run_with_server(cert, check)


def test_cafile_verification_and_session_resumption(cert: tuple[str, str]) -> None:
    async def check(port: int, app: App) -> None:
        async with H3Client("127.0.0.1", port, cafile=cert[0]) as c:
            assert (await c.request("GET", "/echo")).status == 200
            assert not c.resumed
            ticket = c.session_ticket
        assert ticket is not None
        async with H3Client("127.0.0.1", port, cafile=cert[0], session_ticket=ticket) as c:
            assert (await c.request("GET", "/echo")).status == 200
            assert c.resumed

    run_with_server(cert, check)


def test_self_signed_cert_is_idempotent(tmp_path: Any) -> None:
    certfile, keyfile = ensure_self_signed_cert(str(tmp_path))
    before = {p: (os.stat(p).st_mtime_ns, Path(p).read_bytes()) for p in (certfile, keyfile)}
    assert stat.S_IMODE(os.stat(keyfile).st_mode) == 0o600
    assert ensure_self_signed_cert(str(tmp_path)) == (certfile, keyfile)
    assert {p: (os.stat(p).st_mtime_ns, Path(p).read_bytes()) for p in (certfile, keyfile)} == before
