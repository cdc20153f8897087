"""Prometheus metrics of the router (served on --metrics-port)."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge

ROUTED = Counter("infermesh_router_requests_total", "Requests routed, by replica and the policy's reason",
                 ["model", "model_version", "replica", "reason"])
FAILED = Counter("infermesh_router_replica_failures_total", "Streams that a replica failed", ["replica"])
IN_FLIGHT = Gauge("infermesh_router_in_flight", "Requests this router has open on each replica", ["replica"])
HEALTHY = Gauge("infermesh_router_replicas_healthy", "Healthy engine replicas known to this router")
ENTROPY = Gauge("infermesh_router_load_entropy",
                "Normalized Shannon entropy of recent picks across replicas: 1 even, 0 all on one")


def watch_policy(load_entropy: Callable[[float], float], healthy: Callable[[], int]) -> None:
    """Gauges read at scrape time, so they are never stale."""
    ENTROPY.set_function(lambda: load_entropy(time.monotonic()))
    HEALTHY.set_function(healthy)
