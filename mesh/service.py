"""The one shape every service process has: flags -> frozen config -> run_service().

`__main__` parses its flags into the service's frozen config and calls `run_service()`, which sets
up logging, tracing and the mesh's mutual TLS (`--tls-dir`), runs the service's `serve` coroutine
until SIGINT/SIGTERM and shuts tracing down.  A gRPC service's `serve` builds its servicers and
hands them to `serve_grpc()`: the server starts (with health and reflection), metrics are
exported, the replica is announced to discovery, and on a signal it stops gracefully and withdraws, in that order.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from mesh import credentials
from mesh.discovery import BACKENDS, Endpoint, HealthCheck, advertise_address, announce
from mesh.grpcutil import Service, setup_logging
from mesh.telemetry import serve_metrics, setup_tracing, shutdown_tracing


class Hosted(Protocol):
    """The fields every service config has (each config is its own frozen dataclass, so read-only)."""

    @property
    def replica_id(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def advertise(self) -> str: ...
    @property
    def discovery(self) -> str: ...
    @property
    def tls_dir(self) -> str: ...


def add_service_flags(parser: argparse.ArgumentParser, kind: str, port: int | None = None) -> None:
    """The flags every service takes, declared once: --replica-id (`KIND-0`), --host, --advertise, --port
    (given the service's default; the edge has its own HTTP ports instead), --discovery and --tls-dir."""
    parser.add_argument("--replica-id", default=f"{kind}-0")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: every interface)")
    parser.add_argument("--advertise", default="", metavar="HOST[:PORT]",
                        help="the address registered for other hosts to reach (default: --host, or this host's name)")
    if port is not None:
        parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--discovery", choices=BACKENDS, default="static")
    parser.add_argument("--tls-dir", default="", help="mutual TLS: folder of ca.crt, tls.crt, tls.key")


def run_service(kind: str, config: Hosted, serve: Callable[[Any], Coroutine[Any, Any, None]]) -> None:
    """Logging, tracing named after `kind` and the mesh credentials (mutual TLS from config.tls_dir;
    "": plaintext) for every gRPC server and channel of the process, then `serve(config)` in a fresh
    event loop."""
    setup_logging(kind, config.replica_id)
    credentials.configure(config.tls_dir)
    setup_tracing(kind)
    try:
        asyncio.run(serve(config))
    finally:
        shutdown_tracing()


async def wait_for_signal(*also: Awaitable[Any]) -> None:
    """Until SIGINT or SIGTERM arrives, or one of `also` (e.g. the server's own end) completes."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiters = {asyncio.ensure_future(stop.wait()), *(asyncio.ensure_future(a) for a in also)}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


@dataclass(frozen=True)
class Advertised:
    """What discovery tells of a replica beyond its address: the model and version it serves, its region."""
    model: str = ""
    model_version: str = ""
    region: str = "local"


async def announce_self(kind: str, config: Hosted, port: int, *, check: HealthCheck | None = None,
                        advertised: Advertised = Advertised()) -> Callable[[], Awaitable[None]]:
    """Register this replica with the config's discovery backend; returns the withdraw coroutine."""
    address = advertise_address(config.host, port, config.advertise)
    endpoint = Endpoint(kind, config.replica_id, address, model=advertised.model,
                        model_version=advertised.model_version, region=advertised.region)
    return await announce(config.discovery, endpoint, check)


async def serve_grpc(kind: str, config: Hosted, service: Service, *, metrics_port: int = 0,
                     ready: bool = True, on_stop: Callable[[], Awaitable[None]] | None = None,
                     advertised: Advertised = Advertised(),
                     on_announced: Callable[[Callable[[], Awaitable[None]]], None] | None = None) -> None:
    """Start `service` (its servicers already added), export metrics, report SERVING unless the
    service decides that itself (`ready=False`), announce, and serve until a signal.  Then health
    turns NOT_SERVING, in-flight RPCs get a grace period, the replica is withdrawn and `on_stop` runs.
    `on_announced` gets the withdraw coroutine (a drained engine leaves discovery early; once only)."""
    await service.start()
    serve_metrics(metrics_port, config.host)
    if ready:
        await service.ready()
    announced = await announce_self(kind, config, service.port, advertised=advertised)
    withdrawn = False

    async def withdraw() -> None:
        nonlocal withdrawn
        if not withdrawn:
            withdrawn = True
            await announced()

    if on_announced is not None:
        on_announced(withdraw)
    # Shielded: cancelling a pending wait_for_termination() makes the server's shutdown raise CancelledError.
    ended = asyncio.ensure_future(service.server.wait_for_termination())
    await wait_for_signal(asyncio.shield(ended))
    await service.stop()
    ended.cancel()
    await withdraw()
    if on_stop is not None:
        await on_stop()
