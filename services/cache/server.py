"""Cache gRPC servicer: session context here; the KV block RPCs come from BlockRPCs (block_rpcs.py)."""

from __future__ import annotations

import time

import grpc

from mesh import peers
from mesh.chat import from_pb, to_pb
from mesh.grpcutil import Service, rpc_errors
from mesh.telemetry import server_span
from meshpb.v1 import cache_pb2, cache_pb2_grpc
from services.cache import metrics
from services.cache.block_rpcs import BlockRPCs
from services.cache.journal import SessionJournal
from services.cache.sessions import Session, SessionStore
from services.cache.store import BlockStore


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


class CacheServicer(BlockRPCs, cache_pb2_grpc.CacheServicer):
    def __init__(self, sessions: SessionStore, blocks: BlockStore, journal: SessionJournal | None = None):
        self.sessions = sessions
        self.journal = journal          # sessions kept across restarts (services/cache/journal.py); None: memory
        self.blocks = blocks            # the KV block store (services/cache/block_rpcs.py serves it)
        metrics.watch_sessions(lambda: len(self.sessions))

    @rpc_errors
    async def GetSession(self, request: cache_pb2.SessionRequest, context: grpc.aio.ServicerContext
                         ) -> cache_pb2.SessionContext:
        peers.require(context, "GetSession", peers.SESSIONS)
        with server_span("cache.get_session", context) as span:
            session = self.sessions.get(request.session_id, time.monotonic())
            metrics.SESSION_LOOKUPS.labels("miss" if session is None else "hit").inc()
            span.set_attribute("found", session is not None)
            return session_to_pb(request.session_id, session)

    @rpc_errors
    async def AppendSession(self, request: cache_pb2.AppendSessionRequest, context: grpc.aio.ServicerContext
                            ) -> cache_pb2.SessionContext:
        peers.require(context, "AppendSession", peers.SESSIONS)
        with server_span("cache.append_session", context, messages=len(request.messages)):
            messages = [from_pb(m) for m in request.messages]
            now = time.monotonic()
            session = self.sessions.append(request.session_id, messages, now)
            if self.journal is not None:
                self.journal.appended(self.sessions, request.session_id, messages, now)
            return session_to_pb(request.session_id, session)

    @rpc_errors
    async def DeleteSession(self, request: cache_pb2.SessionRequest, context: grpc.aio.ServicerContext
                            ) -> cache_pb2.DeleteSessionResponse:
        peers.require(context, "DeleteSession", peers.SESSIONS)
        with server_span("cache.delete_session", context):
            now = time.monotonic()
            found = self.sessions.delete(request.session_id, now)
            if found and self.journal is not None:
                self.journal.deleted(self.sessions, request.session_id, now)
            return cache_pb2.DeleteSessionResponse(found=found)

    @rpc_errors
    async def GetStats(self, request: cache_pb2.CacheStatsRequest, context: grpc.aio.ServicerContext
                       ) -> cache_pb2.CacheStats:
        peers.require(context, "GetStats", peers.BLOCKS)
        self.sessions.expire(time.monotonic())
        stats = self.block_stats()
        stats.sessions = len(self.sessions)
        return stats


def add_to(service: Service, servicer: CacheServicer) -> None:
    cache_pb2_grpc.add_CacheServicer_to_server(servicer, service.server)
