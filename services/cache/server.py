"""Cache gRPC servicer: session context here (kept by a SessionBackend, session_backends.py); the KV
block RPCs come from BlockRPCs (block_rpcs.py), the edges' response cache from ResponseRPCs
(response_rpcs.py), the edges' stored objects from ObjectRPCs (object_rpcs.py)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path

import grpc

from mesh import peers
from mesh.chat import from_pb, to_pb
from mesh.errors import InvalidArgument, NotFound, Unavailable
from mesh.grpcutil import Service, rpc_errors
from mesh.telemetry import server_span
from meshpb.v1 import cache_pb2, cache_pb2_grpc
from services.cache import metrics
from services.cache.block_rpcs import BlockRPCs
from services.cache.journal import SessionJournal
from services.cache.object_rpcs import ObjectRPCs
from services.cache.objects import ObjectStore
from services.cache.response_rpcs import ResponseRPCs
from services.cache.responses import ResponseStore
from services.cache.session_backends import EmbeddedSessions, SessionBackend
from services.cache.sessions import Session, SessionStore
from services.cache.store import BlockStore

log = logging.getLogger(__name__)

# What GetCheckpointFile serves (mesh/checkpoints/manifest.py's layout), nothing else of the folder.
STORE_FILE = re.compile(r"manifests/[A-Za-z0-9][A-Za-z0-9._-]{0,127}/[A-Za-z0-9][A-Za-z0-9._-]{0,63}\.(json|sig)"
                        r"|chunks/[0-9a-f]{2}/[0-9a-f]{64}\.zst")


def session_to_pb(session_id: str, session: Session | None) -> cache_pb2.SessionContext:
    if session is None:
        return cache_pb2.SessionContext(session_id=session_id, found=False)
    # expires_at is on the monotonic clock; report it as wall-clock time.
    expires_ms = int((time.time() + session.expires_at - time.monotonic()) * 1000)
    return cache_pb2.SessionContext(
        session_id=session_id,
        found=True,
        expires_unix_ms=expires_ms,
        messages=[to_pb(m)
                  for m in session.messages],
    )


class CacheServicer(BlockRPCs, ResponseRPCs, ObjectRPCs, cache_pb2_grpc.CacheServicer):
    def __init__(self, sessions: SessionBackend | SessionStore, blocks: BlockStore,
                 journal: SessionJournal | None = None, checkpoint_store: Path | None = None,
                 objects: ObjectStore | None = None):
        # A bare SessionStore (with its journal, if any) is the embedded backend.
        self.sessions = EmbeddedSessions(sessions, journal) if isinstance(sessions, SessionStore) else sessions
        self.checkpoint_store = checkpoint_store      # served to other regions' `model sync` (GetCheckpointFile)
        self.blocks = blocks            # the KV block store (services/cache/block_rpcs.py serves it)
        self.responses = ResponseStore()    # the edges' shared response cache (response_rpcs.py)
        self.objects = objects if objects is not None else ObjectStore()   # the edges' stored objects
        if isinstance(self.sessions, EmbeddedSessions):
            # Counted at scrape time; Redis's sessions are shared by every replica and counted by GetStats.
            store = self.sessions.store
            metrics.watch_sessions(lambda: len(store))

    @rpc_errors
    async def GetSession(self, request: cache_pb2.SessionRequest, context: grpc.aio.ServicerContext
                         ) -> cache_pb2.SessionContext:
        peers.require(context, "GetSession", peers.SESSIONS)
        with server_span("cache.get_session", context) as span:
            session = await self.sessions.get(request.session_id)
            metrics.SESSION_LOOKUPS.labels("miss" if session is None else "hit").inc()
            span.set_attribute("found", session is not None)
            return session_to_pb(request.session_id, session)

    @rpc_errors
    async def AppendSession(self, request: cache_pb2.AppendSessionRequest, context: grpc.aio.ServicerContext
                            ) -> cache_pb2.SessionContext:
        peers.require(context, "AppendSession", peers.SESSIONS)
        with server_span("cache.append_session", context, messages=len(request.messages)):
            session = await self.sessions.append(request.session_id, [from_pb(m) for m in request.messages])
            return session_to_pb(request.session_id, session)

    @rpc_errors
    async def DeleteSession(self, request: cache_pb2.SessionRequest, context: grpc.aio.ServicerContext
                            ) -> cache_pb2.DeleteSessionResponse:
        peers.require(context, "DeleteSession", peers.SESSIONS)
        with server_span("cache.delete_session", context):
            return cache_pb2.DeleteSessionResponse(found=await self.sessions.delete(request.session_id))

    @rpc_errors
    async def GetCheckpointFile(self, request: cache_pb2.CheckpointFileRequest, context: grpc.aio.ServicerContext
                                ) -> cache_pb2.CheckpointFile:
        peers.require(context, "GetCheckpointFile", peers.CHECKPOINTS)
        if self.checkpoint_store is None:
            raise NotFound("this cache service serves no checkpoint store (start it with --checkpoint-store DIR)")
        if not STORE_FILE.fullmatch(request.path):
            raise InvalidArgument(f"{request.path[:200]!r} is not a checkpoint store file "
                                  "(manifests/NAME/VERSION.json|.sig or chunks/ab/<sha256>.zst)")
        try:
            data = await asyncio.to_thread((self.checkpoint_store / request.path).read_bytes)
        except FileNotFoundError:
            raise NotFound(f"{request.path} is not in this checkpoint store") from None
        return cache_pb2.CheckpointFile(data=data)

    @rpc_errors
    async def GetStats(self, request: cache_pb2.CacheStatsRequest, context: grpc.aio.ServicerContext
                       ) -> cache_pb2.CacheStats:
        peers.require(context, "GetStats", peers.BLOCKS)
        stats = self.block_stats()
        try:
            stats.sessions = await self.sessions.count()
        except Unavailable as exc:
            # The block counters are still worth having (engines probe with GetStats); sessions read 0.
            log.warning("GetStats: sessions not counted: %s", exc.message)
        return stats


def add_to(service: Service, servicer: CacheServicer) -> None:
    cache_pb2_grpc.add_CacheServicer_to_server(servicer, service.server)
