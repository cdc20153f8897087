"""Prometheus metrics of the edge, served on its HTTP port at GET /metrics (the list and the README's
table are mesh/metric_names.py)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter("infermesh_edge_requests_total", "HTTP requests by route and status", ["route", "status"])
TTFT = Histogram("infermesh_edge_time_to_first_token_seconds", "Time to the first text delta",
                 buckets=(0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8))
DURATION = Histogram("infermesh_edge_request_duration_seconds", "Completion request duration",
                     buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120))
COMPLETION_TOKENS = Counter("infermesh_edge_completion_tokens_total", "Completion tokens returned")
SLOW_READERS = Counter("infermesh_edge_slow_readers_total",
                       "Streams ended because the client took longer than --stream-send-timeout to accept a chunk")
ROUTER_FAILOVERS = Counter("infermesh_edge_router_failovers_total",
                           "Requests moved to another router because theirs went away (mid-stream: resumed)",
                           ["router"])
REFUSED = Counter("infermesh_edge_refused_total", "Requests refused by the edge's limits", ["limit"])
