"""`python -m services.cache --replica-id ID --port P`"""

from __future__ import annotations

import argparse
import asyncio
import logging

from mesh.discovery import BACKENDS, Endpoint, advertise_address, announce
from mesh.envargs import apply_env
from mesh.grpcutil import Service, run_until_signalled, setup_logging
from mesh.telemetry import setup_tracing, shutdown_tracing
from services.cache.config import CacheConfig
from services.cache.server import CacheServicer, add_to
from services.cache.sessions import SessionStore

log = logging.getLogger("cache")


def parse(argv: list[str] | None = None) -> CacheConfig:
    p = argparse.ArgumentParser(prog="python -m services.cache")
    p.add_argument("--replica-id", default="cache-0")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: every interface)")
    p.add_argument("--advertise", default="", metavar="HOST[:PORT]",
                   help="the address registered for other hosts to reach (default: --host, or this host's name)")
    p.add_argument("--port", type=int, default=50053)
    p.add_argument("--session-ttl", type=float, default=CacheConfig.session_ttl_s, help="seconds")
    p.add_argument("--discovery", choices=BACKENDS, default="static")
    apply_env(p, "INFERMESH_CACHE")
    a = p.parse_args(argv)
    return CacheConfig(replica_id=a.replica_id, host=a.host, port=a.port, session_ttl_s=a.session_ttl,
                       discovery=a.discovery, advertise=a.advertise)


async def serve(config: CacheConfig) -> None:
    store = SessionStore(config.session_ttl_s, config.max_sessions, config.max_messages_per_session)
    service = Service("meshpb.v1.Cache", config.host, config.port)
    add_to(service, CacheServicer(store))
    await service.start()
    await service.ready()
    advertised = advertise_address(config.host, config.port, config.advertise)
    withdraw = await announce(config.discovery, Endpoint("cache", config.replica_id, advertised))
    log.info("cache %s serving on %s", config.replica_id, service.address)
    await run_until_signalled(service, on_stop=withdraw)


def main(argv: list[str] | None = None) -> None:
    config = parse(argv)
    setup_logging("cache", config.replica_id)
    setup_tracing("cache")
    try:
        asyncio.run(serve(config))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
