"""HTTP/1.1 front door: uvicorn's h11 protocol with a deadline on the request head.

uvicorn closes a keep-alive connection that stays idle, but any byte re-arms nothing: a client
that trickles its request line and headers (slow loris), or connects and sends nothing, holds
the connection forever.  GuardedH11 gives each request head a deadline; the body's own deadline
is the app's (services/edge/transports/asgi.py: read_body, body_timeout_s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.edge.config import EdgeConfig
from services.edge.errors import error_body
from services.edge.transports.asgi import ASGIApp
from services.edge.transports.request_heads import http1_head


def _raw_response(status: str, obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the request head.

    A complete request head must arrive within `header_timeout_s` of the connection opening or of
    the request's first byte, else 408 and close (an idle connection is closed without a word).
    After an early response (413 on Content-Length, 408), the unread rest of the body is drained,
    discarded, under the same deadline.  Each head is checked whole before h11 parses it
    (services/edge/transports/request_heads.py: 431 over 16 KiB or 128 fields, 400 for CL+TE, obs-fold, bare LF, other
    versions), then the connection is closed; other malformed requests get uvicorn's 400, here in
    OpenAI's error shape."""

    header_timeout_s = 10.0
    _deadline: asyncio.TimerHandle | None = None
    _refused = False                            # a head was refused: the connection only drains, then closes

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return                              # the rest of a refused request: dropped until the client closes
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
        elif self.conn.their_state is h11.IDLE:
            if self._deadline is None:          # the first bytes of a new request head
                self._arm()
        elif self.conn.our_state is not h11.DONE:
            self._disarm()                      # a whole head: the app is on it
        # else: our response is done while the client still sends its body: the deadline runs on

    def handle_events(self) -> None:
        # h11 parses a head only from IDLE (a pipelined one waits, PAUSED, until the response before
        # it is done and uvicorn calls this again), so each head is checked here before h11 sees it.
        if self.conn.their_state is h11.IDLE:
            refusal = http1_head(self.conn.trailing_data[0])
            if refusal is not None:
                self._refuse(refusal.status, refusal.message)
                return
        super().handle_events()

    def _refuse(self, status: int, message: str) -> None:
        """Answer, then half-close: closing with unread bytes would reset the connection, and the
        client could lose the answer.  What it still sends is dropped until it closes (or the head
        deadline passes); nothing after a refused head is ever parsed."""
        reason = "431 Request Header Fields Too Large" if status == 431 else "400 Bad Request"
        self.transport.write(_raw_response(reason, error_body(message, "invalid_request_error",
                                                              "invalid_http_request")))
        self._refused = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self._arm()                         # drain the unread body, but not forever

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._refused:
            pass                                # its answer went out: just close
        elif self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            # part of a head arrived (an idle connection is just closed, as keep-alive does)
            self.transport.write(_raw_response("408 Request Timeout", error_body(
                f"the request head did not arrive within {self.header_timeout_s:g} s", "invalid_request_error",
                "request_timeout")))
        elif self.cycle is not None and not self.cycle.response_complete:
            return                              # the app is answering; its own timeouts apply
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_raw_response("400 Bad Request", error_body(
            "invalid HTTP/1.1 request: malformed request line or headers, or a head over 16 KiB",
            "invalid_request_error", "invalid_http_request")))
        self.transport.close()


def http_protocol(config: EdgeConfig) -> type[GuardedH11]:
    return type("EdgeH11", (GuardedH11,), {"header_timeout_s": config.header_timeout_s})


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the edge process stops both transports together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(app: ASGIApp, config: EdgeConfig) -> uvicorn.Server:
    """The HTTP/1.1 server on tcp host:http_port; `serve()` runs it, `should_exit = True` stops it."""
    return _Server(uvicorn.Config(app, host=config.host, port=config.http_port, http=http_protocol(config),
                                  lifespan="off", log_level="warning", timeout_keep_alive=30, access_log=False,
                                  limit_concurrency=config.max_connections))
