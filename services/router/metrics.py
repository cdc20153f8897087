"""Prometheus metrics of the router (served on --metrics-port).

Counters are bumped by dispatch.py and server.py as requests go; the replica table and the
breakers are read at scrape time (ReplicaCollector, fed by admin.py's snapshot), so those gauges
are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

ROUTED = Counter("infermesh_router_requests_total", "Requests routed, by replica and the policy's reason",
                 ["model", "model_version", "replica", "reason"])
FAILED = Counter("infermesh_router_replica_failures_total", "Streams that a replica failed", ["replica"])
IN_FLIGHT = Gauge("infermesh_router_in_flight", "Requests this router has open on each replica", ["replica"])
HEALTHY = Gauge("infermesh_router_replicas_healthy", "Healthy engine replicas known to this router")
ENTROPY = Gauge("infermesh_router_load_entropy",
                "Normalized Shannon entropy of recent picks across replicas: 1 even, 0 all on one")
# level 1: a replica isolated (gone, device error); 2: an attempt retried on another replica;
# 3: a request sent down its model's fallback chain.
FAILOVER = Counter("infermesh_router_failover_total",
                   "Failover actions by level: 1 replica isolated, 2 attempt retried elsewhere, 3 fallback model",
                   ["level"])
# reason: capacity (no admitted replica of the model, or its breaker open) or latency (its P95 time to
# first token over --latency-degrade-p95-ms: failover/latency.py).
DEGRADED = Counter("infermesh_router_degraded_responses_total",
                   "Requests answered by a fallback model (marked degraded, lower confidence), by reason: "
                   "capacity or latency", ["model", "served_model", "reason"])
SHADOW = Counter("infermesh_router_shadow_requests_total",
                 "Requests mirrored to a shadow version, by how the shadow's answer compared with the served one",
                 ["model", "version", "outcome"])
SHED = Counter("infermesh_router_shed_total",
               "Requests refused with UNAVAILABLE + retry-after: no model of the chain had a replica free",
               ["model"])

# Breaker states as gauge values: a state timeline reads 0 closed, 1 half-open, 2 open.
BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}


class ReplicaSample(NamedTuple):
    replica_id: str
    model: str
    model_version: str
    region: str
    admitted: bool               # healthy and not isolated
    running: int
    waiting: int
    kv_used_ratio: float
    weight: float = 1.0


class Snapshot(NamedTuple):
    replicas: list[ReplicaSample]
    breakers: Mapping[str, str]          # replica id -> closed | half_open | open
    model_breakers: Mapping[str, str]    # model -> the same
    latency: Mapping[str, tuple[bool, float | None]] = {}   # model -> (degrading, P95 TTFT s or None)


class ReplicaCollector(Collector):
    """Per-replica load and breaker gauges, read from the router's state when Prometheus scrapes."""

    def __init__(self) -> None:
        self.source: Callable[[float], Snapshot] | None = None

    def collect(self) -> Iterable[GaugeMetricFamily]:
        snap = self.source(time.monotonic()) if self.source is not None else Snapshot([], {}, {})
        return list(self._families(snap))

    def _families(self, snap: Snapshot) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("infermesh_router_replica_up",
                               "1 while the replica is healthy and not isolated (level 1), else 0",
                               labels=["replica", "model", "model_version", "region"])
        running = GaugeMetricFamily("infermesh_router_replica_running",
                                    "Requests running on the replica (its last load report)", labels=["replica"])
        waiting = GaugeMetricFamily("infermesh_router_replica_waiting",
                                    "Requests queued on the replica (its last load report)", labels=["replica"])
        kv = GaugeMetricFamily("infermesh_router_replica_kv_used_ratio",
                               "Fraction of the replica's KV blocks held by running requests", labels=["replica"])
        breaker = GaugeMetricFamily("infermesh_router_breaker_state",
                                    "Replica circuit breaker: 0 closed, 1 half-open, 2 open", labels=["replica"])
        model_breaker = GaugeMetricFamily("infermesh_router_model_breaker_state",
                                          "Model circuit breaker: 0 closed, 1 half-open, 2 open", labels=["model"])
        weight = GaugeMetricFamily("infermesh_router_replica_weight",
                                   "The replica's discovery weight (its share of new requests; 0 a standby)",
                                   labels=["replica"])
        degrading = GaugeMetricFamily("infermesh_router_latency_degrading",
                                      "1 while a share of the model's interactive requests go to its fallback because "
                                      "its P95 time to first token stayed over target, else 0", labels=["model"])
        p95 = GaugeMetricFamily("infermesh_router_time_to_first_token_p95_seconds",
                                "The router's P95 time to first token of the model's interactive requests over the "
                                "latency window (absent with too few samples)", labels=["model"])
        for model, (on, seconds) in snap.latency.items():
            degrading.add_metric([model], 1.0 if on else 0.0)
            if seconds is not None:
                p95.add_metric([model], seconds)
        for r in snap.replicas:
            weight.add_metric([r.replica_id], r.weight)
            up.add_metric([r.replica_id, r.model, r.model_version, r.region], 1.0 if r.admitted else 0.0)
            running.add_metric([r.replica_id], r.running)
            waiting.add_metric([r.replica_id], r.waiting)
            kv.add_metric([r.replica_id], r.kv_used_ratio)
            breaker.add_metric([r.replica_id], BREAKER_VALUES.get(snap.breakers.get(r.replica_id, "closed"), 0))
        for model, state in snap.model_breakers.items():
            model_breaker.add_metric([model], BREAKER_VALUES.get(state, 0))
        yield from (up, running, waiting, kv, breaker, model_breaker, weight, degrading, p95)


REPLICAS = ReplicaCollector()
REGISTRY.register(REPLICAS)


def watch_policy(load_entropy: Callable[[float], float], healthy: Callable[[], int],
                 snapshot: Callable[[float], Snapshot] | None = None) -> None:
    """Gauges read at scrape time, so they are never stale (the last router of a process wins)."""
    ENTROPY.set_function(lambda: load_entropy(time.monotonic()))
    HEALTHY.set_function(healthy)
    if snapshot is not None:
        REPLICAS.source = snapshot
