"""Issue 16, the edge's HTTP strictness: each test reproduces a finding against the real protocol code
(uvicorn + GuardedH11 on a loopback socket, aioquic for HTTP/3) or the ASGI app."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from mesh.apikeys import digest
from mesh.clients.http3 import H3Client
from mesh.clients.router_client import Delta, RouterClient
from meshpb.v1 import router_pb2_grpc
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from services.edge.transports.http3 import serve_http3
from services.edge.transports.http11 import http_server
from services.edge.transports.tls import ensure_self_signed_cert
from tests.fakes.edge_router import CHAT_JSON, FakeRouter
from tests.service.test_http3_server import _free_udp_port

KEYS = (digest("k1"),)


class CountingApp:
    """The edge app, counting the requests that reached it."""

    def __init__(self, **config: Any):
        self.app = EdgeApp(EdgeConfig(http3_port=0, http_port=0, api_key_digests=KEYS, **config),
                           FakeRouter())  # type: ignore[arg-type]
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += 1
        await self.app(scope, receive, send)


@asynccontextmanager
async def http1(app: CountingApp) -> AsyncIterator[int]:
    server = http_server(app, app.app.config)   # type: ignore[arg-type]
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


async def exchange(port: int, data: bytes, one: bool = False) -> bytes:
    """Send `data` in one write; everything the server answers until it closes (or 5 s pass), or
    with `one` its first whole response (Content-Length framed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    chunks = []
    try:
        async with asyncio.timeout(5):
            if one:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
                return head + await reader.readexactly(length)
            while chunk := await reader.read(65536):
                chunks.append(chunk)
    finally:
        writer.close()
    return b"".join(chunks)


def statuses(reply: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) [A-Z]", reply)]


def run(app: CountingApp, data: bytes) -> bytes:
    async def main() -> bytes:
        async with http1(app) as port:
            return await exchange(port, data)
    return asyncio.run(main())


def test_content_length_with_transfer_encoding_is_refused_and_closed() -> None:
    app = CountingApp()
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\n\r\n"
    reply = run(app, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\n"
                     b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled)
    assert statuses(reply) == [400], reply          # one answer, then the connection closed
    assert b"Content-Length and Transfer-Encoding" in reply and app.calls == 0


def test_a_huge_head_in_one_write_is_refused_before_parsing() -> None:
    app = CountingApp()
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(30_000))
    reply = run(app, head + b"\r\n")
    assert len(head) > 120_000 and statuses(reply) == [431] and app.calls == 0
    many = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 200 + b"\r\n"     # 1.4 KB, 201 fields
    assert statuses(run(app, many)) == [431] and app.calls == 0


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\n\r\n",          # obs-fold
    b"GET /health HTTP/1.1\nHost: x\n\n",                                       # bare LF
    b"GET /health HTTP/1.1\r\nHost: x\nX: y\r\n\r\n",                           # one bare LF
    b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n",                                 # not HTTP/1.x
])
def test_lax_heads_are_refused(head: bytes) -> None:
    app = CountingApp()
    reply = run(app, head)
    assert statuses(reply) == [400] and app.calls == 0
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_http_request"


def test_strict_heads_still_serve_pipelined_requests() -> None:
    app = CountingApp()
    get = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
    post = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(CHAT_JSON)) + CHAT_JSON
    assert statuses(run(app, get + post)) == [200, 200] and app.calls == 2


def test_two_authorization_headers_are_refused_on_http1() -> None:
    app = CountingApp()
    reply = run(app, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                     b"Authorization: Bearer k1\r\nConnection: close\r\n\r\n")
    assert statuses(reply) == [400]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "duplicate_header"


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return ensure_self_signed_cert(str(tmp_path_factory.mktemp("tls")))


def test_http3_refuses_two_authorization_headers_and_too_many_fields(cert: tuple[str, str]) -> None:
    async def main() -> None:
        app = CountingApp()
        port = _free_udp_port()
        server = await serve_http3(app, "127.0.0.1", port, *cert)
        try:
            async with asyncio.timeout(20), H3Client("127.0.0.1", port, verify=False) as c:
                # two keys in the dict, one lower-cased name on the wire: two Authorization fields
                r = await c.request("GET", "/health", {"authorization": "Bearer nope", "Authorization": "Bearer k1"})
                assert r.status == 400 and json.loads(r.body)["error"]["code"] == "duplicate_header"
                calls = app.calls
                r = await c.request("GET", "/health", {f"x-{i}": "y" for i in range(300)})
                assert r.status == 431 and app.calls == calls       # refused before the app
                r = await c.request("GET", "/health", {"x-big": "y" * 20_000})
                assert r.status == 431 and app.calls == calls
        finally:
            server.close()

    asyncio.run(main())


class _RefusingRouter(router_pb2_grpc.RouterServicer):
    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is longer than the model's context")
        yield


def test_rejected_one_megabyte_prompts_log_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """1 MB prompts refused by the edge (413, declared or sent) and by the router (400), whole and
    streamed, through uvicorn and the real gRPC client: answered, with nothing logged at WARNING+."""
    async def main() -> list[int]:
        grpc_server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(_RefusingRouter(), grpc_server)
        grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        router = RouterClient(f"127.0.0.1:{grpc_port}")
        app = CountingApp()
        app.app = EdgeApp(app.app.config, router)
        got = []
        try:
            async with http1(app) as port:
                for size, stream in ((1_000_000, False), (1_000_000, True), (1_100_000, False), (1_100_000, True)):
                    body = json.dumps({"model": "m", "prompt": "x" * size, "stream": stream}).encode()
                    got += statuses(await exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                         b"Authorization: Bearer k1\r\n"
                                                         b"Content-Length: %d\r\n\r\n" % len(body) + body, True))
                chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (1_100_000, b"x" * 1_100_000)
                got += statuses(await exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                     b"Authorization: Bearer k1\r\n"
                                                     b"Transfer-Encoding: chunked\r\n\r\n" + chunked, True))
        finally:
            await router.close()
            await grpc_server.stop(0)
        return got

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(main()) == [400, 400, 413, 413, 413]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info] == []


def test_http3_request_head_that_never_completes_gets_408(cert: tuple[str, str]) -> None:
    """Issue 20: a request stream whose HEADERS frame stops half way (slow loris over QUIC) is answered
    408 within the head timeout, and the app never sees it; a whole request on the same connection is
    served."""
    import ssl

    from aioquic.asyncio import QuicConnectionProtocol, connect
    from aioquic.h3.connection import H3_ALPN, H3Connection
    from aioquic.h3.events import DataReceived, HeadersReceived
    from aioquic.quic.configuration import QuicConfiguration

    class Raw(QuicConnectionProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.h3 = H3Connection(self._quic)
            self.status: dict[int, bytes] = {}
            self.body: dict[int, bytes] = {}
            self.done: dict[int, asyncio.Event] = {}

        def quic_event_received(self, event: Any) -> None:
            for e in self.h3.handle_event(event):
                if isinstance(e, HeadersReceived):
                    self.status[e.stream_id] = dict(e.headers)[b":status"]
                elif isinstance(e, DataReceived):
                    self.body[e.stream_id] = self.body.get(e.stream_id, b"") + e.data
                if getattr(e, "stream_ended", False):
                    self.done.setdefault(e.stream_id, asyncio.Event()).set()

        async def wait(self, stream_id: int) -> None:
            await self.done.setdefault(stream_id, asyncio.Event()).wait()

    async def main() -> None:
        app = CountingApp()
        port = _free_udp_port()
        server = await serve_http3(app, "127.0.0.1", port, *cert, head_timeout_s=1.0)
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, verify_mode=ssl.CERT_NONE)
        try:
            async with asyncio.timeout(20), connect("127.0.0.1", port, configuration=config,
                                                    create_protocol=Raw) as client:
                raw = client
                assert isinstance(raw, Raw)
                stalled = raw._quic.get_next_available_stream_id()
                # A HEADERS frame (type 0x01) announcing 100 bytes, of which 5 are sent, then nothing.
                raw._quic.send_stream_data(stalled, b"\x01\x40\x64" + b"\x00" * 5)
                raw.transmit()
                started = asyncio.get_running_loop().time()
                await raw.wait(stalled)
                waited = asyncio.get_running_loop().time() - started
                assert raw.status[stalled] == b"408" and 0.9 < waited < 5, waited
                assert "request head did not arrive" in json.loads(raw.body[stalled])["error"]["message"]
                assert app.calls == 0
                whole = raw._quic.get_next_available_stream_id()
                raw.h3.send_headers(whole, [(b":method", b"GET"), (b":scheme", b"https"),
                                            (b":authority", b"127.0.0.1"), (b":path", b"/openapi.json")],
                                    end_stream=True)
                raw.transmit()
                await raw.wait(whole)
                assert raw.status[whole] == b"200" and app.calls == 1
        finally:
            server.close()

    asyncio.run(main())


def test_a_client_that_stops_reading_a_stream_is_cut_off_and_its_generation_stopped() -> None:
    """Issue 20: a streaming client that reads nothing (its receive buffer full) cannot hold the engine
    slot: once a chunk waits longer than --stream-send-timeout the edge ends the stream and cancels
    the router call."""
    import socket

    from services.edge.metrics import SLOW_READERS
    from tests.security.edge_driver import SlowRouter

    class Flood(SlowRouter):
        async def generate(self, spec: Any, timeout: float | None = None) -> AsyncIterator[Delta]:
            self.started.set()
            try:
                while True:
                    yield Delta("x" * 16_384)
                    await asyncio.sleep(0)
            except (asyncio.CancelledError, GeneratorExit):
                self.cancelled += 1
                raise

    class Served:
        def __init__(self, router: Flood):
            self.app = EdgeApp(EdgeConfig(http_port=0, http3_port=0, stream_send_timeout_s=1.0), router)  # type: ignore[arg-type]

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await self.app(scope, receive, send)

    async def main() -> None:
        router = Flood()
        before = SLOW_READERS._value.get()
        async with http1(Served(router)) as port:  # type: ignore[arg-type]
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                           f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
            try:
                await asyncio.wait_for(router.started.wait(), 10)
                async with asyncio.timeout(20):          # never read: the edge must give up on its own
                    while not router.cancelled:
                        await asyncio.sleep(0.05)
            finally:
                sock.close()
        assert router.cancelled == 1 and SLOW_READERS._value.get() == before + 1

    asyncio.run(main())
