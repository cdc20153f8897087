"""Minimal HTTP/3 client on aioquic, for tests and the CLI.

    tickets = TicketStore("~/.cache/infermesh/h3-tickets.json")  # or TicketStore() in memory (tickets.py)
    async with H3Client("127.0.0.1", 8443, verify=False, tickets=tickets) as c:
        r = await c.request("GET", "/health")
        async with c.stream("POST", "/v1/chat/completions", body=payload) as s:
            async for chunk in s.chunks():
                ...

With a ticket from an earlier connection to the same server, the client resumes the TLS
session and sends its first requests as 0-RTT early data, in the same flight as the
ClientHello; `H3Stream.zero_rtt` says whether the server took one that way. Each ticket is
used once (the edge accepts it once); every connection brings a fresh one back.
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

from mesh.clients.tickets import TicketStore

__all__ = ["H3Client", "H3Response", "H3Stream", "TicketStore"]    # TicketStore: H3Client(tickets=...)

# A connection that used its ticket waits this long, when closing, for the server's next one
# (the server sends it once the handshake completes, possibly after a short answer).
TICKET_WAIT_S = 1.0


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
        self.early_data_accepted: bool | None = None  # known once the handshake completes
        self.handshake_done = asyncio.Event()  # completed, or the connection died trying
        self.handshake_completed = False
        self.early_data_offered = False  # set by H3Client: the ClientHello carries a ticket allowing early data

    @property
    def in_early_data(self) -> bool:
        """Whether what is sent now goes as 0-RTT early data."""
        return self.early_data_offered and not self.handshake_done.is_set()

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
            self.early_data_accepted = event.early_data_accepted
            self.handshake_completed = True
            self.handshake_done.set()
        elif isinstance(event, ConnectionTerminated):
            self.handshake_done.set()  # wake waiters; the exchanges fail below
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

    def __init__(self, status: int, headers: dict[str, str], exchange: _Exchange, zero_rtt: bool = False) -> None:
        self.status = status
        self.headers = headers
        self.zero_rtt = zero_rtt  # the request went as 0-RTT early data and the server accepted it
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
    """One QUIC connection; `tickets` (or `session_ticket`) makes it resume, and send in 0-RTT.

    `early_data=False` still resumes but sends nothing before the handshake completes. If the
    server refuses the early data (it restarted, or the ticket was used already), aioquic
    resends the request under 1-RTT keys once its loss detection gives the 0-RTT packets up,
    about one round trip later than a plain full handshake would have answered.
    """

    def __init__(  # noqa: PLR0913 -- keyword-only connection options, as aioquic's own connect() takes them
        self,
        host: str,
        port: int,
        *,
        verify: bool = True,
        cafile: str | None = None,
        session_ticket: SessionTicket | None = None,
        tickets: TicketStore | None = None,
        early_data: bool = True,
        server_name: str = "localhost",
        timeout: float = 30.0,
    ) -> None:
        self.host, self.port = host, port
        self.timeout = timeout
        self.tickets = tickets
        self.ticket_key = f"{server_name}@{host}:{port}"
        if session_ticket is None and tickets is not None:
            session_ticket = tickets.take(self.ticket_key)
        self.session_ticket: SessionTicket | None = session_ticket  # updated as the server issues new ones
        self.used_ticket = session_ticket is not None
        self._new_ticket = asyncio.Event()
        self._config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=server_name)
        if not verify:
            self._config.verify_mode = ssl.CERT_NONE
        elif cafile:
            self._config.load_verify_locations(cafile)
        self._config.session_ticket = session_ticket
        # aioquic offers early data only for a valid ticket issued under this server name.
        self._early = bool(
            early_data and session_ticket is not None and session_ticket.max_early_data_size is not None
            and session_ticket.is_valid and session_ticket.server_name == server_name
        )
        self._cm: AbstractAsyncContextManager[QuicConnectionProtocol] | None = None
        self._proto: _ClientProtocol | None = None
        self.early_data_sent = False  # some request went as 0-RTT early data

    def _save_ticket(self, ticket: SessionTicket) -> None:
        self.session_ticket = ticket
        if self.tickets is not None:
            self.tickets.put(self.ticket_key, ticket)
        self._new_ticket.set()

    async def __aenter__(self) -> H3Client:
        # With early data, don't wait for the handshake: the first request rides in the
        # ClientHello's flight (aioquic sends nothing until the first transmit).
        self._cm = connect(
            self.host,
            self.port,
            configuration=self._config,
            create_protocol=_ClientProtocol,
            session_ticket_handler=self._save_ticket,
            wait_connected=not self._early,
        )
        async with asyncio.timeout(self.timeout):
            proto = await self._cm.__aenter__()
        assert isinstance(proto, _ClientProtocol)
        proto.early_data_offered = self._early
        self._proto = proto
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._cm is not None:
            # _proto stays: resumed / early_data_accepted / handshake_summary() still answer after closing.
            cm, proto, self._cm = self._cm, self._proto, None
            if exc_type is None and proto is not None:
                await self._await_next_ticket(proto)
            await cm.__aexit__(exc_type, exc, tb)

    async def _await_next_ticket(self, proto: _ClientProtocol) -> None:
        # The server sends the next ticket once the handshake completes, which may be after a
        # short answer; leaving before it arrives would cost the next connection its 0-RTT.
        started = proto.handshake_completed or self.early_data_sent
        if self.tickets is None or not started or self._new_ticket.is_set():
            return
        try:
            async with asyncio.timeout(TICKET_WAIT_S):
                await proto.handshake_done.wait()
                await self._new_ticket.wait()
        except TimeoutError:
            pass

    @property
    def resumed(self) -> bool:
        """Whether the TLS handshake resumed a previous session (used a ticket)."""
        return self._proto is not None and self._proto.session_resumed

    @property
    def early_data_accepted(self) -> bool | None:
        """Whether the server accepted our 0-RTT early data (None: none offered, or handshake pending)."""
        if self._proto is None or not self._proto.early_data_offered:
            return None
        return self._proto.early_data_accepted

    def handshake_summary(self) -> str:
        """One line for humans (`infermesh chat --http3 --verbose`)."""
        if self._proto is None or not self._proto.handshake_completed:
            return "handshake not completed"
        if self.early_data_sent:
            if self.early_data_accepted:
                return "0-RTT: resumed session, request sent as early data and accepted"
            return "0-RTT refused by the server (ticket unknown or used): request resent after a full handshake"
        if self.resumed:
            return "1-RTT: resumed session"
        return "1-RTT: full handshake" + (" (ticket not accepted)" if self.used_ticket else "")

    @asynccontextmanager
    async def stream(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
    ) -> AsyncIterator[H3Stream]:
        """Send a request; yield once response headers arrive. Leaving early cancels the stream."""
        if self._cm is None or self._proto is None:
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
        early = proto.in_early_data
        self.early_data_sent |= early
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
            # 1-RTT keys come from the server's Finished, so by now the handshake outcome is known;
            # refused early data was resent by aioquic's loss recovery, under 1-RTT keys.
            yield H3Stream(status, resp_headers, ex, zero_rtt=early and bool(proto.early_data_accepted))
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
