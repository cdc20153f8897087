"""HTTP/3 front door: runs an ASGI 3 app (http scope only) on aioquic's QUIC server.

Each request stream becomes one ASGI task. Response DATA is transmitted as soon as the
app sends it, because the edge streams tokens over SSE and any buffering here shows up
directly as inter-token latency.

0-RTT: a request that arrives in TLS early data runs at once only if the early-data policy
(services/edge/transports/zero_rtt.py) says a replay of it is harmless; otherwise it waits for the handshake.
It reaches the app with `early-data: 1` (RFC 8470 section 5.1).

A request stream's HEADERS frame must arrive whole within `head_timeout_s` of the stream's first
byte (the edge's --header-timeout, as for HTTP/1.1): a client trickling it gets 408 and the stream
is stopped, so a slow-loris client cannot hold stream state open.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from aioquic.asyncio import QuicConnectionProtocol, serve
from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)

from services.edge.transports.asgi import ASGIApp, Message, Scope
from services.edge.transports.request_heads import h3_headers, h3_scope
from services.edge.transports.zero_rtt import EarlyDataPolicy, SessionTicketStore, replay_tolerable

log = logging.getLogger(__name__)

# Connection-specific headers are forbidden in HTTP/3 (RFC 9114 4.2); peers treat them
# as a malformed message, so drop them rather than let an HTTP/1.1-minded app break H3.
_HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}


def _error_body(status: int, message: str, kind: str) -> bytes:
    # OpenAI-style error envelope, matching what the HTTP/1.1 edge returns.
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


HIGH_WATER = 1 << 20          # bytes of a response stream sent and not yet acknowledged, before send() waits
_ERROR_500 = _error_body(500, "internal error", "server_error")
_ERROR_400 = _error_body(400, "bad request", "invalid_request_error")


class _RequestStream:
    """One HTTP/3 request stream bridged to one ASGI app invocation."""

    def __init__(self, proto: _H3ServerProtocol, stream_id: int, scope: Scope) -> None:
        self._proto = proto
        self.stream_id = stream_id
        self.scope = scope
        # None is a wake-up sentinel pushed on disconnect.
        self._body: asyncio.Queue[tuple[bytes, bool] | None] = asyncio.Queue()
        self._body_done = False
        self._disconnected = False
        self._started = False
        self._done = False
        self._finished = asyncio.Event()  # response complete or peer gone
        self.early = False  # headers arrived in 0-RTT early data, before the handshake completed

    def feed_body(self, data: bytes, end: bool) -> None:
        self._body.put_nowait((data, not end))

    def disconnect(self) -> None:
        if not self._disconnected:
            self._disconnected = True
            self._body.put_nowait(None)
            self._finished.set()

    async def receive(self) -> Message:
        if not self._disconnected and not self._body_done:
            item = await self._body.get()
            if item is not None:
                data, more = item
                self._body_done = not more
                return {"type": "http.request", "body": data, "more_body": more}
        # Body fully read: apps (e.g. SSE) park here to learn that the client went away.
        await self._finished.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self._disconnected or self._done:
            return  # client gone or response over: ASGI apps may keep sending; drop it
        kind = message["type"]
        if kind == "http.response.start":
            if self._started:
                raise RuntimeError("http.response.start sent twice")
            headers = [(b":status", str(message["status"]).encode())]
            headers += [
                (bytes(k).lower(), bytes(v))
                for k, v in message.get("headers", [])
                if bytes(k).lower() not in _HOP_BY_HOP
            ]
            self._started = True
            self._write(lambda h3: h3.send_headers(self.stream_id, headers))
        elif kind == "http.response.body":
            if not self._started:
                raise RuntimeError("http.response.body sent before http.response.start")
            body = bytes(message.get("body", b""))
            more = bool(message.get("more_body", False))
            if body or not more:
                self._write(lambda h3: h3.send_data(self.stream_id, body, end_stream=not more))
            if not more:
                self._done = True
                self._finished.set()
            else:
                await self._drain()

    async def _drain(self) -> None:
        """Backpressure, as TCP gives: wait while over HIGH_WATER bytes of this stream are unacknowledged
        (a client that stops reading stops granting credit), so a slow reader blocks the app's send and
        meets the edge's --stream-send-timeout.  aioquic keeps them in the stream sender's buffer."""
        while not self._disconnected:
            stream = getattr(self._proto._quic, "_streams", {}).get(self.stream_id)
            if len(getattr(getattr(stream, "sender", None), "_buffer", b"")) <= HIGH_WATER:
                return
            await asyncio.sleep(0.02)

    def _write(self, op: Callable[[H3Connection], None]) -> None:
        h3 = self._proto.h3
        try:
            assert h3 is not None
            op(h3)
        except Exception:
            # STOP_SENDING/reset raced us: the stream is gone, which is a disconnect.
            log.debug("h3 stream %d: write failed, treating as disconnect", self.stream_id, exc_info=True)
            self.disconnect()
            return
        # Flush now rather than at the next received datagram: one SSE chunk per token.
        self._proto.transmit()

    async def _whole_body(self) -> bytes | None:
        """Read the whole request body ahead of the app (None: peer gone); the app still gets it."""
        parts: list[bytes] = []
        while True:
            item = await self._body.get()
            if item is None:
                self._body.put_nowait(None)
                return None
            parts.append(item[0])
            if not item[1]:
                body = b"".join(parts)
                self._body.put_nowait((body, False))
                return body

    async def _admit_early(self) -> bool:
        """Decide when an early-data request runs: now (marked early-data: 1), or after the handshake."""
        body = await self._whole_body()
        if body is None:
            return False
        if self._proto.handshake_done:
            return True  # the rest of the body came after the handshake: this is no replay
        if self._proto.early_data_policy(self.scope, body):
            self.scope["headers"].append((b"early-data", b"1"))
            return True
        log.debug("h3 stream %d: %s %s held until the handshake completes", self.stream_id,
                  self.scope["method"], self.scope["path"])
        await self._proto.handshake_settled.wait()
        return not self._disconnected

    async def run(self, app: ASGIApp) -> None:
        try:
            if self.early and not await self._admit_early():
                return
            await app(self.scope, self.receive, self.send)
            if not self._done and not self._disconnected:
                log.error("ASGI app returned without completing the response (%s)", self.scope["path"])
                self._abort()
        except Exception:
            log.exception("ASGI app failed on %s %s", self.scope["method"], self.scope["path"])
            self._abort()
        finally:
            self._finished.set()
            self._proto.request_done(self.stream_id)

    def _abort(self) -> None:
        if self._disconnected:
            return
        if not self._started:
            self.respond(500, _ERROR_500)
        else:
            # Headers already went out; the only honest signal left is a stream reset.
            self._proto.reset_stream(self.stream_id)
        self._done = True

    def respond(self, status: int, body: bytes) -> None:
        headers = [(b":status", str(status).encode()), (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        self._started = True
        self._write(lambda h3: h3.send_headers(self.stream_id, headers))
        self._write(lambda h3: h3.send_data(self.stream_id, body, end_stream=True))


class _H3ServerProtocol(QuicConnectionProtocol):
    """One QUIC connection: demultiplexes HTTP/3 request streams into ASGI tasks."""

    def __init__(self, *args: Any, app: ASGIApp, early_data_policy: EarlyDataPolicy, head_timeout_s: float = 10.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app = app
        self.head_timeout_s = head_timeout_s
        self._heads: dict[int, asyncio.TimerHandle] = {}   # request streams whose HEADERS are incomplete
        self.early_data_policy = early_data_policy
        # Set when the handshake completes or the connection dies: held early requests wake up.
        self.handshake_settled = asyncio.Event()
        self.handshake_done = False
        self.h3: H3Connection | None = None
        self._requests: dict[int, _RequestStream] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # strong refs: the loop only keeps weak ones
        self._peer: tuple[str, int] | None = None
        self._local: tuple[str, int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sockname = transport.get_extra_info("sockname")
        self._local = (sockname[0], sockname[1]) if sockname else None

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # The server hands us the sender address per datagram; keeping the latest one
        # follows connection migration without reaching into QuicConnection internals.
        self._peer = (addr[0], addr[1])
        super().datagram_received(data, addr)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated) and event.alpn_protocol in H3_ALPN:
            self.h3 = H3Connection(self._quic)
        elif isinstance(event, HandshakeCompleted):
            self.handshake_done = True
            self.handshake_settled.set()
        elif isinstance(event, ConnectionTerminated):
            for req in list(self._requests.values()):
                req.disconnect()
            self.handshake_settled.set()
        elif isinstance(event, StreamReset | StopSendingReceived):
            reset = self._requests.get(event.stream_id)
            if reset is not None:
                reset.disconnect()
        elif (isinstance(event, StreamDataReceived) and event.stream_id % 4 == 0 and event.data
              and event.stream_id not in self._requests and event.stream_id not in self._heads):
            # A client request stream's first bytes: its HEADERS frame has head_timeout_s to complete.
            self._heads[event.stream_id] = asyncio.get_running_loop().call_later(
                self.head_timeout_s, self._head_expired, event.stream_id)
        if self.h3 is not None:
            for h3_event in self.h3.handle_event(event):
                self._h3_event_received(h3_event)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            req = self._requests.get(event.stream_id)
            if req is not None:  # trailers: not exposed to ASGI, but they may end the body
                if event.stream_ended:
                    req.feed_body(b"", end=True)
                return
            self._start_request(event)
        elif isinstance(event, DataReceived):
            req = self._requests.get(event.stream_id)
            if req is not None:
                req.feed_body(event.data, end=event.stream_ended)

    def _head_expired(self, stream_id: int) -> None:
        # (On a connection or stream gone meanwhile the answer goes nowhere: _write drops it.)
        self._heads.pop(stream_id, None)
        if stream_id in self._requests or self.h3 is None:
            return
        _RequestStream(self, stream_id, {"method": "", "path": ""}).respond(408, _error_body(
            408, f"the request head did not arrive within {self.head_timeout_s:g} s", "invalid_request_error"))
        with contextlib.suppress(Exception):       # the stream may be gone meanwhile: nothing to stop
            self._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_INCOMPLETE)
        self.transmit()

    def _start_request(self, event: HeadersReceived) -> None:
        timer = self._heads.pop(event.stream_id, None)
        if timer is not None:
            timer.cancel()
        refusal = h3_headers(event.headers)
        scope = None if refusal else h3_scope(event.headers, self._peer, self._local)
        req = _RequestStream(self, event.stream_id, scope or {"method": "", "path": ""})
        if refusal is not None:
            req.respond(refusal.status, _error_body(refusal.status, refusal.message, "invalid_request_error"))
            return
        if scope is None:
            req.respond(400, _ERROR_400)
            return
        # Stream data before the handshake completed can only have come as 0-RTT early data:
        # 1-RTT packets from the client follow its Finished.
        req.early = not self.handshake_done and self._quic.tls.early_data_accepted
        if event.stream_ended:
            req.feed_body(b"", end=True)
        self._requests[event.stream_id] = req
        task = asyncio.get_running_loop().create_task(req.run(self._app))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def reset_stream(self, stream_id: int) -> None:
        self._quic.reset_stream(stream_id, ErrorCode.H3_INTERNAL_ERROR)
        self.transmit()

    def request_done(self, stream_id: int) -> None:
        self._requests.pop(stream_id, None)


async def serve_http3(
    app: ASGIApp,
    host: str,
    port: int,
    certfile: str,
    keyfile: str,
    *,
    ticket_store: SessionTicketStore | None = None,
    early_data_policy: EarlyDataPolicy = replay_tolerable,
    head_timeout_s: float = 10.0,
) -> QuicServer:
    """Listen for HTTP/3 on UDP host:port; the returned server's `.close()` stops it.

    Session tickets (from `ticket_store`) let clients resume with 0-RTT early data; aioquic
    advertises the largest max_early_data, so the flow-control limits the ticket carries
    (max_data, 1 MiB) are what bound a first flight. `early_data_policy` picks which early
    requests run before the handshake completes. Loss recovery is aioquic's RFC 9002 default
    (100 ms initial RTT, so a lost first flight is resent after 200 ms).
    """
    config = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    config.load_cert_chain(certfile, keyfile)
    store = ticket_store if ticket_store is not None else SessionTicketStore()
    return await serve(
        host,
        port,
        configuration=config,
        create_protocol=functools.partial(_H3ServerProtocol, app=app, early_data_policy=early_data_policy,
                                          head_timeout_s=head_timeout_s),
        session_ticket_fetcher=store.pop,
        session_ticket_handler=store.add,
    )
