"""Minimal HTTP/3 client on aioquic, for tests and the CLI.

    async with H3Client("127.0.0.1", 8443, verify=False) as c:
        r = await c.request("GET", "/health")
        async with c.stream("POST", "/v1/chat/completions", body=payload) as s:
            async for chunk in s.chunks():
                ...
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, QuicEvent, StreamReset
from aioquic.tls import SessionTicket


@dataclass
class H3Response:
    status: int
    headers: dict[str, str]
    body: bytes


class _Exchange:
    """Receive-side state of one request stream, fed from protocol callbacks."""

    def __init__(self) -> None:
        self.headers: asyncio.Future[list[tuple[bytes, bytes]]] = asyncio.get_running_loop().create_future()
        # bytes = DATA payload, None = end of stream, exception = stream/connection failure.
        self.chunks: asyncio.Queue[bytes | None | BaseException] = asyncio.Queue()
        self.ended = False

    def fail(self, exc: BaseException) -> None:
        if not self.headers.done():
            self.headers.set_exception(exc)
            self.headers.exception()  # mark retrieved: nobody may be awaiting it
        if not self.ended:
            self.ended = True
            self.chunks.put_nowait(exc)


class _ClientProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self._exchanges: dict[int, _Exchange] = {}
        self.session_resumed = False

    def open(self, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int, _Exchange]:
        if self._closed.is_set():
            raise ConnectionError("connection closed")
        stream_id = self._quic.get_next_available_stream_id()
        ex = _Exchange()
        self._exchanges[stream_id] = ex
        self.h3.send_headers(stream_id, headers, end_stream=not body)
        if body:
            self.h3.send_data(stream_id, body, end_stream=True)
        self.transmit()
        return stream_id, ex

    def cancel(self, stream_id: int) -> None:
        # STOP_SENDING tells the server we stopped reading; that is what reaches the
        # ASGI app as http.disconnect. Resetting our side is a no-op if already acked.
        self._exchanges.pop(stream_id, None)
        try:
            self._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        except ValueError:
            pass  # stream already discarded by aioquic
        self.transmit()

    def forget(self, stream_id: int) -> None:
        self._exchanges.pop(stream_id, None)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.session_resumed = event.session_resumed
        elif isinstance(event, ConnectionTerminated):
            for pending in self._exchanges.values():
                pending.fail(ConnectionError(f"connection closed: {event.reason_phrase or event.error_code}"))
        elif isinstance(event, StreamReset) and event.stream_id in self._exchanges:
            self._exchanges[event.stream_id].fail(ConnectionResetError(f"stream reset: {event.error_code}"))
        for h3_event in self.h3.handle_event(event):
            ex = self._exchanges.get(getattr(h3_event, "stream_id", -1))
            if ex is None or ex.ended:
                continue
            if isinstance(h3_event, HeadersReceived):
                status = dict(h3_event.headers).get(b":status", b"")
                if not ex.headers.done() and not status.startswith(b"1"):  # skip interim 1xx
                    ex.headers.set_result(h3_event.headers)
            elif isinstance(h3_event, DataReceived) and h3_event.data:
                ex.chunks.put_nowait(h3_event.data)
            if isinstance(h3_event, HeadersReceived | DataReceived) and h3_event.stream_ended:
                ex.ended = True
                ex.chunks.put_nowait(None)


class H3Stream:
    """A response whose headers have arrived; the body is read incrementally."""

    def __init__(self, status: int, headers: dict[str, str], exchange: _Exchange) -> None:
        self.status = status
        self.headers = headers
        self._ex = exchange

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield DATA payloads as they arrive (one per server send, unless coalesced)."""
        while True:
            item = await self._ex.chunks.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])


class H3Client:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        verify: bool = True,
        cafile: str | None = None,
        session_ticket: SessionTicket | None = None,
        server_name: str = "localhost",
        timeout: float = 30.0,
    ) -> None:
        self.host, self.port = host, port
        self.timeout = timeout
        self.session_ticket: SessionTicket | None = session_ticket  # updated as the server issues new ones
        self._config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=server_name)
        if not verify:
            self._config.verify_mode = ssl.CERT_NONE
        elif cafile:
            self._config.load_verify_locations(cafile)
        self._config.session_ticket = session_ticket
        self._cm: AbstractAsyncContextManager[QuicConnectionProtocol] | None = None
        self._proto: _ClientProtocol | None = None

    def _save_ticket(self, ticket: SessionTicket) -> None:
        self.session_ticket = ticket

    async def __aenter__(self) -> H3Client:
        self._cm = connect(
            self.host,
            self.port,
            configuration=self._config,
            create_protocol=_ClientProtocol,
            session_ticket_handler=self._save_ticket,
        )
        async with asyncio.timeout(self.timeout):
            proto = await self._cm.__aenter__()
        assert isinstance(proto, _ClientProtocol)
        self._proto = proto
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._cm is not None:
            cm, self._cm, self._proto = self._cm, None, None
            await cm.__aexit__(exc_type, exc, tb)

    @property
    def resumed(self) -> bool:
        """Whether the TLS handshake resumed a previous session (used a ticket)."""
        return self._proto is not None and self._proto.session_resumed

    @asynccontextmanager
    async def stream(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
    ) -> AsyncIterator[H3Stream]:
        """Send a request; yield once response headers arrive. Leaving early cancels the stream."""
        if self._proto is None:
            raise RuntimeError("H3Client is not connected; use `async with`")
        proto = self._proto
        authority = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        h3_headers = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
        ]
        h3_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        if body:
            h3_headers.append((b"content-length", str(len(body)).encode()))
        stream_id, ex = proto.open(h3_headers, body)
        try:
            async with asyncio.timeout(self.timeout):
                raw = await ex.headers
            status = int(dict(raw)[b":status"])
            resp_headers: dict[str, str] = {}
            for k, v in raw:
                if not k.startswith(b":"):
                    name, value = k.decode(), v.decode()
                    # Repeated fields fold into one comma-separated value (RFC 9110 5.3).
                    resp_headers[name] = f"{resp_headers[name]}, {value}" if name in resp_headers else value
            yield H3Stream(status, resp_headers, ex)
        finally:
            if ex.ended:
                proto.forget(stream_id)
            else:
                proto.cancel(stream_id)

    async def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
    ) -> H3Response:
        async with asyncio.timeout(self.timeout), self.stream(method, path, headers, body) as s:
            return H3Response(s.status, s.headers, await s.read())
