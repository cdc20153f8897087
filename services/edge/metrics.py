"""Prometheus metrics of the edge, served on its HTTP port at GET /metrics (the list and the table in
docs/operations.md, "Observability", are mesh/metric_names.py)."""

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
TENANT_REQUESTS = Counter("infermesh_edge_tenant_requests_total",
                          "Requests by authenticated tenant (API key, keys-file tenant or JWT), tier and status",
                          ["tenant", "tier", "status"])
TENANT_TOKENS = Counter("infermesh_edge_tenant_tokens_total", "Prompt + completion tokens used, by tenant and tier",
                        ["tenant", "tier"])
CONTENT_FILTERED = Counter("infermesh_edge_content_filtered_total",
                           "Inputs refused and outputs cut by the content policy (rules file or classifier)",
                           ["direction", "category"])
RESPONSE_CACHE = Counter("infermesh_edge_response_cache_total",
                         "Response cache lookups and stores: hit_memory, hit_shared, miss, stale_version, bypass, "
                         "stored, shared_error", ["outcome"])
BATCH_LINES = Counter("infermesh_edge_batch_lines_total",
                      "Batch lines (/v1/batches): completed, failed (answered 4xx/5xx), retried (a 429/503 tried "
                      "again)",
                      ["outcome"])
