"""`python -m mesh.edge --replica-id ID [--host ADDR] [--http-port P] [--http3-port P] --router ADDR`"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from mesh import model_store
from mesh.client import RouterClient
from mesh.discovery import BACKENDS, Endpoint, HealthCheck, announce, join_address
from mesh.edge.app import EdgeApp
from mesh.edge.auth import load_keys
from mesh.edge.config import EdgeConfig
from mesh.edge.http3 import ensure_self_signed_cert, serve_http3
from mesh.grpcutil import setup_logging
from mesh.telemetry import setup_tracing, shutdown_tracing

log = logging.getLogger("edge")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this process stops both transports together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def parse(argv: list[str] | None = None) -> EdgeConfig:
    p = argparse.ArgumentParser(prog="python -m mesh.edge")
    p.add_argument("--replica-id", default="edge-0")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--http3-port", type=int, default=8443, help="0 disables HTTP/3")
    p.add_argument("--router", default="127.0.0.1:50051")
    p.add_argument("--cert-dir", default="", help="default: <infermesh home>/tls")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--discovery", choices=BACKENDS, default="static")
    a = p.parse_args(argv)
    return EdgeConfig(replica_id=a.replica_id, host=a.host, http_port=a.http_port, http3_port=a.http3_port,
                      router=a.router, cert_dir=a.cert_dir or str(model_store.home() / "tls"),
                      api_key_digests=load_keys(),
                      admin_key_digests=load_keys(variable="INFERMESH_ADMIN_KEYS"), max_body_bytes=a.max_body_bytes,
                      discovery=a.discovery)


async def serve(config: EdgeConfig) -> None:
    router = RouterClient(config.router)
    app = EdgeApp(config, router)
    http = _Server(uvicorn.Config(app, host=config.host, port=config.http_port, http="h11", lifespan="off",
                                  log_level="warning", timeout_keep_alive=30, access_log=False))
    http3 = None
    if config.http3_port:
        Path(config.cert_dir).mkdir(parents=True, exist_ok=True)
        cert, key = ensure_self_signed_cert(config.cert_dir)
        http3 = await serve_http3(app, config.host, config.http3_port, cert, key)
        log.info("HTTP/3 on udp %s:%d (self-signed certificate: %s)", config.host, config.http3_port, cert)
    if not app.keys.enabled:
        log.warning("no API keys configured (INFERMESH_API_KEYS): serving loopback only, without auth")
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
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
        address = join_address(host, config.http_port)
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
