"""`python -m mesh.edge --replica-id ID [--host ADDR] [--http-port P] [--http3-port P] --router ADDR [limits]`

Every flag can also come from INFERMESH_EDGE_<FLAG> (mesh/envargs.py; `infermesh up` passes its
environment on), e.g. INFERMESH_EDGE_MAX_CONCURRENT=64; the rate limits also read the shorter
INFERMESH_RATE_LIMIT and INFERMESH_TOKEN_LIMIT.  A flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from mesh import model_store
from mesh.client import RouterClient
from mesh.discovery import BACKENDS, Endpoint, HealthCheck, advertise_address, announce
from mesh.edge.app import EdgeApp
from mesh.edge.auth import load_keys
from mesh.edge.config import EdgeConfig
from mesh.edge.http3 import ensure_self_signed_cert, serve_http3
from mesh.edge.openai import error_body
from mesh.edge.ratelimit import parse_rate
from mesh.envargs import apply_env
from mesh.grpcutil import setup_logging
from mesh.telemetry import setup_tracing, shutdown_tracing

log = logging.getLogger("edge")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this process stops both transports together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _raw_response(status: str, obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the request head.

    uvicorn closes a keep-alive connection that stays idle, but any byte re-arms nothing: a client
    that trickles its request line and headers (slow loris), or connects and sends nothing, holds
    the connection forever.  Here a complete request head must arrive within `header_timeout_s` of
    the connection opening or of the request's first byte, else 408 and close (an idle
    connection is closed without a word).  After an early
    response (413 on Content-Length, 408), the unread rest of the body is drained, discarded, under
    the same deadline.  The body itself is the app's (EdgeApp.read_body: body_timeout_s).  Malformed
    requests and heads over h11's 16 KiB limit get uvicorn's 400, here in OpenAI's error shape."""

    header_timeout_s = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
        elif self.conn.their_state is h11.IDLE:
            if self._deadline is None:          # the first bytes of a new request head
                self._arm()
        elif self.conn.our_state is not h11.DONE:
            self._disarm()                      # a whole head: the app is on it
        # else: our response is done while the client still sends its body: the deadline runs on

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
        if self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
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


def parse(argv: list[str] | None = None) -> EdgeConfig:
    p = argparse.ArgumentParser(prog="python -m mesh.edge")
    p.add_argument("--replica-id", default="edge-0")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--advertise", default="", metavar="HOST[:PORT]",
                   help="the address registered for other hosts to reach (default: --host, or this host's name)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--http3-port", type=int, default=8443, help="0 disables HTTP/3")
    p.add_argument("--router", default="127.0.0.1:50051")
    p.add_argument("--cert-dir", default="", help="default: <infermesh home>/tls")
    p.add_argument("--discovery", choices=BACKENDS, default="static")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    p.add_argument("--max-messages", type=int, default=1000, help="longer chat `messages` get 400")
    p.add_argument("--rate-limit", default=os.environ.get("INFERMESH_RATE_LIMIT", ""),
                   help="requests per API key (per address without keys): 5/s, 300/m; '' or 0: off")
    p.add_argument("--token-limit", default=os.environ.get("INFERMESH_TOKEN_LIMIT", ""),
                   help="prompt + completion tokens per minute per API key (60000, or 1000/s); '' or 0: off")
    p.add_argument("--max-concurrent", type=int, default=256,
                   help="completions in flight across all callers; the excess gets 503 + Retry-After")
    p.add_argument("--max-connections", type=int, default=4096, help="HTTP/1.1 connections; past it uvicorn's 503")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds for a request head to arrive (slow clients get 408)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds for a request body to arrive (slow clients get 408)")
    apply_env(p, "INFERMESH_EDGE")
    a = p.parse_args(argv)
    try:
        rate_limit, token_limit = parse_rate(a.rate_limit), parse_rate(a.token_limit, default_unit="m")
    except ValueError as exc:
        p.error(str(exc))
    return EdgeConfig(replica_id=a.replica_id, host=a.host, http_port=a.http_port, http3_port=a.http3_port,
                      router=a.router, cert_dir=a.cert_dir or str(model_store.home() / "tls"),
                      api_key_digests=load_keys(),
                      admin_key_digests=load_keys(variable="INFERMESH_ADMIN_KEYS"), max_body_bytes=a.max_body_bytes,
                      max_messages=a.max_messages, discovery=a.discovery, rate_limit=rate_limit,
                      token_limit=token_limit, max_concurrent=a.max_concurrent, max_connections=a.max_connections,
                      header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout, advertise=a.advertise)


def http_protocol(config: EdgeConfig) -> type[GuardedH11]:
    return type("EdgeH11", (GuardedH11,), {"header_timeout_s": config.header_timeout_s})


async def serve(config: EdgeConfig) -> None:
    router = RouterClient(config.router)
    app = EdgeApp(config, router)
    http = _Server(uvicorn.Config(app, host=config.host, port=config.http_port, http=http_protocol(config),
                                  lifespan="off", log_level="warning", timeout_keep_alive=30, access_log=False,
                                  limit_concurrency=config.max_connections))
    http3 = None
    if config.http3_port:
        Path(config.cert_dir).mkdir(parents=True, exist_ok=True)
        cert, key = ensure_self_signed_cert(config.cert_dir)
        http3 = await serve_http3(app, config.host, config.http3_port, cert, key)
        log.info("HTTP/3 on udp %s:%d (self-signed certificate: %s)", config.host, config.http3_port, cert)
    if not app.keys.enabled:
        log.warning("no API keys configured (INFERMESH_API_KEYS): serving loopback only, without auth")
    log.info("limits: requests %s, tokens %s per caller; %d in flight; bodies up to %d bytes",
             config.rate_limit or "unlimited", config.token_limit or "unlimited", config.max_concurrent,
             config.max_body_bytes)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(http.serve())
    log.info("HTTP/1.1 on tcp %s:%d", config.host, config.http_port)
    stopper = asyncio.create_task(stop.wait())
    withdraw = None
    while not http.started and not http_task.done():
        await asyncio.sleep(0.05)
    if http.started:
        # Announced only once it answers: the registry's HTTP check probes /health.
        address = advertise_address(config.host, config.http_port, config.advertise)
        withdraw = await announce(config.discovery, Endpoint("edge", config.replica_id, address),
                                  HealthCheck.http(f"http://{address}/health"))
    await asyncio.wait({http_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if withdraw is not None:
        await withdraw()
    http.should_exit = True
    if http3 is not None:
        http3.close()
    await asyncio.gather(http_task, return_exceptions=True)
    stopper.cancel()
    await router.close()
    if not http.started:
        raise SystemExit(f"edge: cannot listen on {config.host}:{config.http_port}")


def main(argv: list[str] | None = None) -> None:
    config = parse(argv)
    setup_logging("edge", config.replica_id)
    setup_tracing("edge")
    try:
        asyncio.run(serve(config))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
