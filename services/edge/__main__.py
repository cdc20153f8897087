"""`python -m services.edge --replica-id ID [--host ADDR] [--http-port P] [--http3-port P] --router ADDR... [limits]`

Every flag can also come from INFERMESH_EDGE_<FLAG> (mesh/envargs.py; `infermesh up` passes its
environment on), e.g. INFERMESH_EDGE_MAX_CONCURRENT=64; the rate limits also read the shorter
INFERMESH_RATE_LIMIT and INFERMESH_TOKEN_LIMIT.  A flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from mesh.apikeys import load_keys
from mesh.clients.router_pool import RouterPool
from mesh.discovery import HealthCheck, advertise_address, make_discovery
from mesh.envargs import apply_env
from mesh.models import home
from mesh.ratelimit import parse_rate
from mesh.service import add_service_flags, announce_self, run_service, wait_for_signal
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from services.edge.metrics import ROUTER_FAILOVERS
from services.edge.transports.http3 import serve_http3
from services.edge.transports.http11 import http_server
from services.edge.transports.tls import ensure_self_signed_cert

log = logging.getLogger("edge")


def parse(argv: list[str] | None = None) -> EdgeConfig:
    p = argparse.ArgumentParser(prog="python -m services.edge")
    add_service_flags(p, "edge")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--http3-port", type=int, default=8443, help="0 disables HTTP/3")
    p.add_argument("--router", action="append", default=[], metavar="HOST:PORT[,HOST:PORT...]",
                   help="a router; repeat (or comma-separate) for several: requests are spread over them and a "
                        "stream whose router dies resumes on another (default 127.0.0.1:50051; with --discovery "
                        "consul, also every router registered there)")
    p.add_argument("--cert-dir", default="", help="default: <infermesh home>/tls")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    p.add_argument("--max-messages", type=int, default=1000, help="longer chat `messages` get 400")
    p.add_argument("--rate-limit", default=os.environ.get("INFERMESH_RATE_LIMIT", ""),
                   help="requests per API key (per address without keys): 5/s, 300/m; '' or 0: off")
    p.add_argument("--token-limit", default=os.environ.get("INFERMESH_TOKEN_LIMIT", ""),
                   help="prompt + completion tokens per minute per API key (60000, or 1000/s); '' or 0: off")
    p.add_argument("--auth-failure-limit", default="10/m",
                   help="failed API or admin keys per client address before 429 (any key): 10/m; '' or 0: off")
    p.add_argument("--max-concurrent", type=int, default=256,
                   help="router calls in flight across all callers (a request takes one a call: prompts x n); "
                        "the excess gets 503 + Retry-After")
    p.add_argument("--max-connections", type=int, default=4096, help="HTTP/1.1 connections; past it uvicorn's 503")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds for a request head to arrive (slow clients get 408)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds for a request body to arrive (slow clients get 408)")
    p.add_argument("--stream-send-timeout", type=float, default=30.0,
                   help="seconds a streaming client may take to accept a chunk before its stream is ended with "
                        "an error and its generation aborted (slow readers)")
    p.add_argument("--batch-concurrency", type=int, default=8,
                   help="a batch's lines under way at once (/v1/batches; they run in the engines' batch class)")
    p.add_argument("--batch-share", type=float, default=0.25,
                   help="batch lines' places in flight, all tenants together, as a share of --max-concurrent (apart "
                        "from the interactive ones; lines beyond it wait); above 0, at most 1")
    p.add_argument("--batch-tenant-share", type=float, default=0.5,
                   help="one tenant's batch lines in flight, as a share of the batch places; above 0, at most 1")
    p.add_argument("--tiers-file", default=os.environ.get("INFERMESH_TIERS_FILE", ""),
                   help="JSON: tier -> requests, tokens, priority, cache_class (reloaded when it changes)")
    p.add_argument("--content-policy", default=os.environ.get("INFERMESH_CONTENT_POLICY", ""),
                   help="JSON rules for input and output content (reloaded when it changes); '': none")
    p.add_argument("--content-classifier", default="", metavar="HOST:PORT",
                   help="a ContentClassifier gRPC service consulted on every input (and whole output)")
    p.add_argument("--cache-service", default="", metavar="HOST:PORT",
                   help="the cache service: the response cache's shared tier (default: the edge's memory only)")
    p.add_argument("--response-cache-ttl", type=float, default=300.0,
                   help="seconds a deterministic answer is reused; 0 turns the response cache off")
    p.add_argument("--response-cache-mb", type=float, default=64.0, help="the edge's in-memory response cache")
    apply_env(p, "INFERMESH_EDGE")
    a = p.parse_args(argv)
    try:
        rate_limit, token_limit = parse_rate(a.rate_limit), parse_rate(a.token_limit, default_unit="m")
        auth_failure_limit = parse_rate(a.auth_failure_limit, default_unit="m")
    except ValueError as exc:
        p.error(str(exc))
    return EdgeConfig(replica_id=a.replica_id, host=a.host, http_port=a.http_port, http3_port=a.http3_port,
                      router=",".join(a.router) or "127.0.0.1:50051", cert_dir=a.cert_dir or str(home() / "tls"),
                      api_key_digests=load_keys({"INFERMESH_API_KEYS": os.environ.get("INFERMESH_API_KEYS", "")}),
                      keys_file=os.environ.get("INFERMESH_API_KEYS_FILE", ""), tiers_file=a.tiers_file,
                      jwt_secret=os.environ.get("INFERMESH_JWT_SECRET", ""),
                      jwt_jwks_file=os.environ.get("INFERMESH_JWT_JWKS_FILE", ""),
                      jwt_audience=os.environ.get("INFERMESH_JWT_AUDIENCE", ""),
                      jwt_issuer=os.environ.get("INFERMESH_JWT_ISSUER", ""),
                      content_policy=a.content_policy, content_classifier=a.content_classifier,
                      cache_service=a.cache_service, response_cache_ttl_s=a.response_cache_ttl,
                      response_cache_bytes=int(a.response_cache_mb * (1 << 20)),
                      admin_key_digests=load_keys(variable="INFERMESH_ADMIN_KEYS"), max_body_bytes=a.max_body_bytes,
                      max_messages=a.max_messages, discovery=a.discovery, rate_limit=rate_limit,
                      token_limit=token_limit, auth_failure_limit=auth_failure_limit,
                      max_concurrent=a.max_concurrent, max_connections=a.max_connections,
                      header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout, advertise=a.advertise,
                      stream_send_timeout_s=a.stream_send_timeout,
                      tls_dir=a.tls_dir, batch_concurrency=a.batch_concurrency,
                      batch_share=a.batch_share, batch_tenant_share=a.batch_tenant_share)


async def serve(config: EdgeConfig) -> None:
    """Both transports on one app until SIGINT/SIGTERM (or the HTTP/1.1 server's own end); announced
    only once HTTP/1.1 answers, since the registry's HTTP check probes /health; on the way out the
    replica is withdrawn first, then both transports stop, then the router channel closes."""
    registry = make_discovery("consul") if config.discovery == "consul" else None
    router = RouterPool([a for a in config.router.split(",") if a], registry,
                        on_failover=lambda address: ROUTER_FAILOVERS.labels(address).inc())
    router.start()
    app = EdgeApp(config, router)
    http = http_server(app, config)
    http3 = None
    if config.http3_port:
        Path(config.cert_dir).mkdir(parents=True, exist_ok=True)
        cert, key = ensure_self_signed_cert(config.cert_dir)
        http3 = await serve_http3(app, config.host, config.http3_port, cert, key,
                                  head_timeout_s=config.header_timeout_s)
        log.info("HTTP/3 on udp %s:%d (self-signed certificate: %s)", config.host, config.http3_port, cert)
    if not app.admission.enabled:
        log.warning("no API keys or JWTs configured (INFERMESH_API_KEYS): serving loopback only, without auth")
    log.info("limits: requests %s, tokens %s per caller; %d in flight; bodies up to %d bytes",
             config.rate_limit or "unlimited", config.token_limit or "unlimited", config.max_concurrent,
             config.max_body_bytes)
    http_task = asyncio.create_task(http.serve())
    log.info("HTTP/1.1 on tcp %s:%d", config.host, config.http_port)
    # Listening for signals from here on, during startup too; shielded, because wait_for_signal
    # cancels what it waits on and uvicorn must stop through should_exit, finishing its requests.
    stopped = asyncio.create_task(wait_for_signal(asyncio.shield(http_task)))
    withdraw = None
    while not http.started and not http_task.done():
        await asyncio.sleep(0.05)
    if http.started:
        app.batch_runner.start()         # batches left running by a dead edge (or this one before a restart)
        address = advertise_address(config.host, config.http_port, config.advertise)
        withdraw = await announce_self("edge", config, config.http_port,
                                       check=HealthCheck.http(f"http://{address}/health"))
    await stopped
    if withdraw is not None:
        await withdraw()
    http.should_exit = True
    if http3 is not None:
        http3.close()
    await asyncio.gather(http_task, return_exceptions=True)
    await app.batch_runner.close()
    await app.completions.close()
    await app.stored.close()
    await router.close()
    if registry is not None:
        await registry.close()
    if not http.started:
        raise SystemExit(f"edge: cannot listen on {config.host}:{config.http_port}")


def main(argv: list[str] | None = None) -> None:
    run_service("edge", parse(argv), serve)


if __name__ == "__main__":
    main()
