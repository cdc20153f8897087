"""The Router service's messages from the router's plain values: the conversions server.py and relay.py
answer with, kept out of server.py so that it holds only handlers (tests/unit/test_layout.py keeps it thin)."""

from __future__ import annotations

from mesh.clients.values import ServedBy
from meshpb.v1 import common_pb2, router_pb2
from services.router.admin import Routing
from services.router.events import RecentEvents


def served_by_pb(s: ServedBy) -> common_pb2.ServedBy:
    return common_pb2.ServedBy(replica=s.replica, model=s.model, model_version=s.model_version, region=s.region,
                               degraded=s.degraded, confidence=s.confidence, confidence_source=s.confidence_source,
                               degraded_by=s.degraded_by)


def routing_pb(routing: Routing) -> router_pb2.ModelRouting:
    reply = router_pb2.ModelRouting(model=routing.model, default_version=routing.default_version,
                                    canary=routing.canary, versions=routing.versions,
                                    shadow_version=routing.shadow[0], shadow_share=routing.shadow[1])
    if routing.shadow_stats is not None:
        reply.shadow.CopyFrom(router_pb2.ShadowStats(**routing.shadow_stats))   # type: ignore[arg-type]
    return reply


def fill_recent(reply: router_pb2.ListReplicasResponse, recent: RecentEvents) -> None:
    """The console's part of ListReplicas: the router's recent events and first-token times."""
    reply.ttft_p50_ms, reply.ttft_p95_ms = recent.ttft_ms()
    for e in recent.events:
        reply.events.add(unix_ms=e.unix_ms, kind=e.kind, model=e.model, replica=e.replica, detail=e.detail)
