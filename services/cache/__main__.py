"""`python -m services.cache --replica-id ID --port P [--hot-mb N] [--cold-dir DIR --cold-mb N]
[--session-store embedded|redis://HOST:PORT/DB]`"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from mesh.envargs import apply_env
from mesh.grpcutil import MAX_MESSAGE_BYTES, Service
from mesh.service import add_service_flags, run_service, serve_grpc
from services.cache.block_metrics import watch
from services.cache.config import EMBEDDED, REDIS_FORM, CacheConfig
from services.cache.eviction import POLICIES
from services.cache.journal import SessionJournal
from services.cache.objects import ObjectStore
from services.cache.server import CacheServicer, add_to
from services.cache.session_backends import EmbeddedSessions, SessionBackend
from services.cache.sessions import SessionStore
from services.cache.store import BlockStore

log = logging.getLogger("cache")


def parse_weights(text: str) -> tuple[tuple[str, float], ...]:
    """`premium=4,standard=2,batch=1` -> (("premium", 4.0), ...)."""
    try:
        pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
        return tuple((name.strip(), float(weight)) for name, weight in pairs)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected CLASS=WEIGHT,... (e.g. premium=4,standard=2,batch=1): {exc}"
                                         ) from exc


def parse(argv: list[str] | None = None) -> CacheConfig:
    p = argparse.ArgumentParser(prog="python -m services.cache")
    add_service_flags(p, "cache", port=50053)
    p.add_argument("--session-ttl", type=float, default=CacheConfig.session_ttl_s, help="seconds")
    p.add_argument("--hot-mb", type=int, default=CacheConfig.hot_mb, help="RAM tier budget for KV blocks (MiB)")
    p.add_argument("--cold-dir", default=CacheConfig.cold_dir,
                   help="disk tier folder, kept across restarts (default: no disk tier)")
    p.add_argument("--cold-mb", type=int, default=CacheConfig.cold_mb, help="disk tier budget (MiB)")
    p.add_argument("--eviction", choices=list(POLICIES), default=CacheConfig.eviction)
    p.add_argument("--tenant-weights", type=parse_weights, default=CacheConfig.tenant_weights,
                   help="SLA class weights for --eviction tenant, e.g. premium=4,standard=2,batch=1")
    p.add_argument("--max-block-mb", type=int, default=CacheConfig.max_block_mb, help="largest KV block (MiB)")
    p.add_argument("--checkpoint-store", default="", metavar="DIR",
                   help="serve this checkpoint store (mesh/checkpoints) to `infermesh model sync --from grpc://...`")
    p.add_argument("--session-store", default=EMBEDDED, metavar="embedded|URL",
                   help=f"where sessions live: 'embedded' (this process, with --sessions-dir) or Redis, {REDIS_FORM}"
                        " (shared by every cache replica using it; INFERMESH_CACHE_SESSION_STORE keeps a password "
                        "off the command line)")
    p.add_argument("--sessions-dir", default="", metavar="DIR",
                   help="the embedded store: keep sessions across restarts in DIR/sessions.jsonl (default: memory)")
    p.add_argument("--objects-dir", default="", metavar="DIR",
                   help="keep the edges' stored objects (stored responses) across restarts in DIR/objects.jsonl "
                        "(default: --sessions-dir, else memory)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics on this port; 0: off")
    apply_env(p, "INFERMESH_CACHE")
    a = p.parse_args(argv)
    try:
        return CacheConfig(replica_id=a.replica_id, host=a.host, port=a.port, session_ttl_s=a.session_ttl,
                           discovery=a.discovery, hot_mb=a.hot_mb, cold_dir=a.cold_dir, cold_mb=a.cold_mb,
                           eviction=a.eviction, tenant_weights=a.tenant_weights, max_block_mb=a.max_block_mb,
                           metrics_port=a.metrics_port, advertise=a.advertise, tls_dir=a.tls_dir,
                           session_store=a.session_store, sessions_dir=a.sessions_dir, objects_dir=a.objects_dir,
                           checkpoint_store=a.checkpoint_store)
    except ValueError as exc:
        p.error(str(exc))


async def open_sessions(config: CacheConfig) -> SessionBackend:
    """The session store --session-store names: Redis (checked once, not required to be up yet), or
    this process's own, brought back from its journal when there is one."""
    if config.redis is not None:
        from services.cache.redis_sessions import RedisSessions  # redis-py only where it is used

        shared = RedisSessions(config.redis, config.session_ttl_s, config.max_messages_per_session)
        down = await shared.ping()
        if down:
            log.warning("%s; session RPCs answer UNAVAILABLE until it is", down)
        return shared
    store = SessionStore(config.session_ttl_s, config.max_sessions, config.max_messages_per_session)
    journal = None
    if config.sessions_dir:
        journal = SessionJournal(config.sessions_dir)
        journal.load(store, time.monotonic())
    return EmbeddedSessions(store, journal)


async def serve(config: CacheConfig) -> None:
    sessions = await open_sessions(config)
    log.info("%s", sessions.describe())
    blocks = BlockStore.create(config.hot_mb << 20, config.cold_dir or None, config.cold_mb << 20, config.eviction,
                               dict(config.tenant_weights), config.max_block_mb << 20)
    service = Service("meshpb.v1.Cache", config.host, config.port, max_receive_bytes=MAX_MESSAGE_BYTES)
    objects = ObjectStore(config.objects_dir or config.sessions_dir or None)
    add_to(service, CacheServicer(sessions, blocks,
                                  checkpoint_store=Path(config.checkpoint_store) if config.checkpoint_store else None,
                                  objects=objects))
    if config.metrics_port:
        watch(blocks, config.replica_id)        # registered before /metrics is served
    log.info("cache %s serving on %s (KV blocks: %d MiB hot, %s, %s eviction)", config.replica_id, service.address,
             config.hot_mb, f"{config.cold_mb} MiB cold in {config.cold_dir}" if config.cold_dir else "no cold tier",
             config.eviction)

    async def stop() -> None:
        await blocks.flush()     # blocks still being written to the cold tier are finished first
        await sessions.close()
        objects.close()

    await serve_grpc("cache", config, service, metrics_port=config.metrics_port, on_stop=stop)


def main(argv: list[str] | None = None) -> None:
    run_service("cache", parse(argv), serve)


if __name__ == "__main__":
    main()
