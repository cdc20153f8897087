"""Every Prometheus metric the mesh exports: the stable names that dashboards, alerts and the docs use.

This list is the one source the checks read: tests/e2e/test_observability.py scrapes a running mesh and
requires each metric here on its service's endpoint, and tests/unit/test_dashboard.py requires every
metric the Grafana dashboard queries to be here.  `python -m mesh.metric_names` prints the metrics
table of docs/operations.md ("Observability").

Where each service serves /metrics (`infermesh up`, before --port-offset): the edge on its HTTP port
(8000), engines on 9100+i, the router on 9180, the tokenizer on 9181, the cache on 9182.
"""

from __future__ import annotations

from typing import NamedTuple

SERVICES = ("edge", "router", "tokenizer", "engine", "cache", "launcher")
GRPC_SERVICES = ("router", "tokenizer", "engine", "cache")


class Metric(NamedTuple):
    name: str                     # as exported; counters end in _total
    type: str                     # counter | gauge | histogram
    services: tuple[str, ...]     # which services export it
    labels: tuple[str, ...]
    meaning: str


def _m(name: str, kind: str, service: str | tuple[str, ...], labels: str, meaning: str) -> Metric:
    services = (service,) if isinstance(service, str) else service
    return Metric(name, kind, services, tuple(labels.split()) if labels else (), meaning)


METRICS: tuple[Metric, ...] = (
    # -- edge (HTTP) -----------------------------------------------------------------------
    _m("infermesh_edge_requests_total", "counter", "edge", "route status", "HTTP requests by route and status code"),
    _m("infermesh_edge_refused_total", "counter", "edge", "limit",
       "Requests refused by the edge's limits: requests, tokens (rate limits, 429), in_flight (503), "
       "auth_failures (a client address past its failed-key limit, 429), signature (a bad, stale or replayed "
       "signed request, 401)"),
    _m("infermesh_edge_time_to_first_token_seconds", "histogram", "edge", "",
       "Streaming request: arrival to the first text delta, as the client sees it"),
    _m("infermesh_edge_request_duration_seconds", "histogram", "edge", "", "Completion request duration"),
    _m("infermesh_edge_completion_tokens_total", "counter", "edge", "", "Completion tokens returned to clients"),
    _m("infermesh_edge_slow_readers_total", "counter", "edge", "",
       "Streams ended because the client took longer than --stream-send-timeout to accept a chunk"),
    _m("infermesh_edge_router_failovers_total", "counter", "edge", "router",
       "Requests moved to another router because theirs went away (mid-stream: resumed from the tokens sent)"),
    _m("infermesh_edge_tenant_requests_total", "counter", "edge", "tenant tier status",
       "Requests by authenticated tenant (keys-file or JWT tenant; a key without one: key:<digest prefix>; "
       "no keys: anonymous), tier and HTTP status"),
    _m("infermesh_edge_tenant_tokens_total", "counter", "edge", "tenant tier",
       "Prompt + completion tokens used, by tenant and tier"),
    _m("infermesh_edge_response_cache_total", "counter", "edge", "outcome",
       "Response cache: hit_memory, hit_shared, miss, stale_version (the default version changed), bypass, "
       "stored, shared_error"),
    _m("infermesh_edge_batch_lines_total", "counter", "edge", "outcome",
       "Batch lines (/v1/batches): completed, failed (answered 4xx/5xx), retried (a 429/503 tried again)"),
    _m("infermesh_edge_content_filtered_total", "counter", "edge", "direction category",
       "Inputs refused (400 content_filter) and outputs cut (finish_reason content_filter) by the content "
       "policy, by direction (input, output) and category"),
    # -- every gRPC service (router, tokenizer, engine, cache) ----------------------------
    _m("infermesh_grpc_server_requests_total", "counter", GRPC_SERVICES, "service method code",
       "gRPC requests served, by method (its span name, e.g. router.generate) and status code (OK, UNAVAILABLE...)"),
    _m("infermesh_grpc_server_duration_seconds", "histogram", GRPC_SERVICES, "service method",
       "gRPC request duration; a streaming call until its last message"),
    # -- router ----------------------------------------------------------------------------
    _m("infermesh_router_requests_total", "counter", "router", "model model_version replica reason",
       "Attempts routed to a replica, by reason: balance, prefix, session, region, spill, pinned, failover, fallback"),
    _m("infermesh_router_replica_failures_total", "counter", "router", "replica", "Streams a replica failed"),
    _m("infermesh_router_failover_total", "counter", "router", "level",
       "Failover actions: level 1 a replica isolated, 2 an attempt retried elsewhere, 3 a fallback model used"),
    _m("infermesh_router_degraded_responses_total", "counter", "router", "model served_model reason",
       "Requests answered by a fallback model (marked degraded, lower confidence), by reason: capacity (no "
       "admitted replica of the model, or its breaker open) or latency (its P95 time to first token over target)"),
    _m("infermesh_router_shed_total", "counter", "router", "model",
       "Requests refused with 503 + Retry-After: no replica of the model's chain could take them"),
    _m("infermesh_router_shadow_requests_total", "counter", "router", "model version outcome",
       "Requests mirrored to a shadow version (shadow traffic), by outcome: matched (same text as the served "
       "answer), diverged, failed; a fallback model's mirrors (measured agreement) as version=\"fallback:MODEL\""),
    _m("infermesh_router_in_flight", "gauge", "router", "replica", "Requests this router has open on each replica"),
    _m("infermesh_router_replicas_healthy", "gauge", "router", "", "Healthy engine replicas"),
    _m("infermesh_router_load_entropy", "gauge", "router", "",
       "Normalized Shannon entropy of recent picks across replicas: 1 even, 0 all on one"),
    _m("infermesh_router_replica_up", "gauge", "router", "replica model model_version region",
       "1 while the replica is healthy and not isolated, else 0"),
    _m("infermesh_router_replica_running", "gauge", "router", "replica", "Requests running on the replica"),
    _m("infermesh_router_replica_waiting", "gauge", "router", "replica", "Requests queued on the replica"),
    _m("infermesh_router_replica_kv_used_ratio", "gauge", "router", "replica",
       "Fraction of the replica's KV blocks held by running requests"),
    _m("infermesh_router_replica_weight", "gauge", "router", "replica",
       "The replica's discovery weight: its share of new requests relative to the others; 0 a standby"),
    _m("infermesh_router_latency_degrading", "gauge", "router", "model",
       "1 while a share of the model's interactive requests go to its fallback because its P95 time to first "
       "token stayed over target (level 3 by latency), else 0 (only with --latency-degrade-p95-ms)"),
    _m("infermesh_router_time_to_first_token_p95_seconds", "gauge", "router", "model",
       "The router's P95 time to first token of the model's interactive requests over the latency window "
       "(only with --latency-degrade-p95-ms; absent with too few samples)"),
    _m("infermesh_router_breaker_state", "gauge", "router", "replica",
       "Replica circuit breaker: 0 closed, 1 half-open, 2 open"),
    _m("infermesh_router_model_breaker_state", "gauge", "router", "model",
       "Model circuit breaker: 0 closed, 1 half-open, 2 open"),
    # -- tokenizer -------------------------------------------------------------------------
    _m("infermesh_tokenizer_tokens_total", "counter", "tokenizer", "method",
       "Token ids produced (chat_template, encode)"),
    # -- engine ----------------------------------------------------------------------------
    _m("infermesh_engine_requests_total", "counter", "engine", "replica finish_reason",
       "Generate requests ended: stop, length, abort, error, cancelled, rejected"),
    _m("infermesh_engine_requests_running", "gauge", "engine", "replica", "Requests in the running batch"),
    _m("infermesh_engine_requests_waiting", "gauge", "engine", "replica", "Queue length: requests waiting"),
    _m("infermesh_engine_batch_size", "histogram", "engine", "replica", "Sequences in one engine step"),
    _m("infermesh_engine_queue_wait_seconds", "histogram", "engine", "replica",
       "Arrival to the first step that ran the request"),
    _m("infermesh_engine_time_to_first_token_seconds", "histogram", "engine", "replica",
       "Arrival to the first generated token"),
    _m("infermesh_engine_time_per_output_token_seconds", "histogram", "engine", "replica",
       "Mean gap between a request's generated tokens"),
    _m("infermesh_engine_kv_blocks_used", "gauge", "engine", "replica", "KV cache blocks in use or cached"),
    _m("infermesh_engine_kv_blocks_free", "gauge", "engine", "replica", "KV cache blocks free or evictable"),
    _m("infermesh_engine_prefix_query_tokens_total", "counter", "engine", "replica",
       "Prompt tokens looked up in the prefix cache"),
    _m("infermesh_engine_prefix_hit_tokens_total", "counter", "engine", "replica",
       "Prompt tokens served from the prefix cache; hit rate = rate(hit) / rate(query)"),
    _m("infermesh_engine_shared_cache_blocks_total", "counter", "engine", "replica event",
       "KV blocks exchanged with the shared cache: fetched, rejected (another layout), published, dropped "
       "(never sent: cache down or slow, outbox full)"),
    _m("infermesh_engine_shared_cache_errors_total", "counter", "engine", "replica",
       "Failed calls to the shared KV cache (each leaves it alone for a few seconds)"),
    _m("infermesh_engine_preemptions_total", "counter", "engine", "replica",
       "Requests preempted for KV blocks (recomputed later: a running request that could not grow, or batch-class "
       "work whose blocks an interactive request took)"),
    _m("infermesh_engine_paused_rows_total", "counter", "engine", "replica",
       "Running requests left out of a step with their KV kept: their tenant's fair share spent, or an interactive "
       "request took the row of a batch-class one"),
    _m("infermesh_engine_interrupted_steps_total", "counter", "engine", "replica",
       "Steps running only batch-class rows given up between two layers because an interactive request arrived "
       "(their rows run again in a later step)"),
    _m("infermesh_engine_capped_steps_total", "counter", "engine", "replica",
       "Steps that left requests out because their rows were capped so that a light tenant is not slowed more than "
       "--fair-slowdown times below its share"),
    _m("infermesh_engine_tenant_queued", "gauge", "engine", "replica tenant",
       "Requests waiting for admission, by tenant (common: requests that name none)"),
    _m("infermesh_engine_tenant_running", "gauge", "engine", "replica tenant", "Requests holding KV blocks, by tenant"),
    _m("infermesh_engine_tenant_tokens_total", "counter", "engine", "replica tenant",
       "Tokens computed (prefill and decode) by tenant; rate() gives each tenant's share of the engine"),
    _m("infermesh_engine_lora_adapters", "gauge", "engine", "replica", "LoRA adapters loaded (LoadAdapter)"),
    _m("infermesh_engine_lora_requests_total", "counter", "engine", "replica adapter",
       "Generate requests that ran with a LoRA adapter, by adapter"),
    _m("infermesh_engine_lora_load_seconds", "histogram", "engine", "replica",
       "Time to read a LoRA adapter's folder (LoadAdapter)"),
    _m("infermesh_engine_draft_tokens_total", "counter", "engine", "replica",
       "Speculative draft tokens verified (prompt lookup or the draft model)"),
    _m("infermesh_engine_draft_accepted_tokens_total", "counter", "engine", "replica",
       "Of the draft tokens verified, those accepted"),
    _m("infermesh_engine_draft_speedup", "gauge", "engine", "replica",
       "The draft model's last drafted step: its tokens a second (drafting included) over a plain decode step's of "
       "the same size; drafting stops at sizes where this stays below 1"),
    _m("infermesh_engine_constrained_requests_total", "counter", "engine", "replica grammar",
       "Requests with a structured-output constraint; grammar: cached (compiled before), compiled, or refused: "
       "invalid (does not compile, or crashed the compiler), rate_limited (the tenant's --grammar-compile-rate), "
       "busy (--grammar-compiles running and no slot free in time), timeout (stopped at "
       "--grammar-compile-timeout-s), remembered (refused before as too slow: refused at once)"),
    _m("infermesh_engine_step_seconds", "histogram", "engine", "replica", "Duration of one engine step"),
    _m("infermesh_engine_step_tokens_total", "counter", "engine", "replica", "Tokens computed, prefill and decode"),
    _m("infermesh_engine_generated_tokens_total", "counter", "engine", "replica",
       "Tokens generated; rate() gives tokens/s"),
    _m("infermesh_engine_plan_info", "gauge", "engine",
       "replica device dtype matmul attention ops graphs matmul_large split_rows kv_dtype",
       "Always 1: the replica's execution plan (device, dtype, matmul kinds and the rows they split at, "
       "kernels, graph mode, KV cache dtype) as labels"),
    # -- cache -----------------------------------------------------------------------------
    _m("infermesh_cache_session_lookups_total", "counter", "cache", "result", "Session lookups: hit or miss"),
    _m("infermesh_cache_sessions", "gauge", "cache", "",
       "Live session contexts held by the embedded store (0 with --session-store redis://...: count the Redis "
       "keys infermesh:session:*)"),
    # -- cache: the shared KV block store (services/cache/block_metrics.py) ------------------
    _m("infermesh_cache_block_hits_total", "counter", "cache", "replica tier", "Block lookups found in a tier"),
    _m("infermesh_cache_block_misses_total", "counter", "cache", "replica tier", "Block lookups not found in a tier"),
    _m("infermesh_cache_block_evictions_total", "counter", "cache", "replica tier",
       "Blocks evicted from a tier to make room"),
    _m("infermesh_cache_block_bytes_total", "counter", "cache", "replica direction",
       "Block payload bytes received (in) and served (out)"),
    _m("infermesh_cache_block_promotions_total", "counter", "cache", "replica", "Cold hits copied into RAM"),
    _m("infermesh_cache_block_demotions_total", "counter", "cache", "replica",
       "Blocks pushed out of RAM that were kept on disk"),
    _m("infermesh_cache_block_corrupt_total", "counter", "cache", "replica",
       "Torn or corrupt block files found and deleted"),
    _m("infermesh_cache_block_prefix_queried_total", "counter", "cache", "replica",
       "Chained block hashes asked about by MatchPrefix"),
    _m("infermesh_cache_block_prefix_matched_total", "counter", "cache", "replica",
       "Chained block hashes MatchPrefix found stored; shared prefix hit rate = rate(matched) / rate(queried)"),
    _m("infermesh_cache_block_tier_bytes", "gauge", "cache", "replica tier", "Bytes held by a tier"),
    _m("infermesh_cache_block_tier_blocks", "gauge", "cache", "replica tier", "Blocks held by a tier"),
    _m("infermesh_cache_block_tier_budget_bytes", "gauge", "cache", "replica tier", "Byte budget of a tier"),
    _m("infermesh_launcher_restarts_total", "counter", "launcher", "service",
       "Children `infermesh up` restarted after they died (engine, router, tokenizer, cache, edge)"),
)

_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def names() -> set[str]:
    return {m.name for m in METRICS}


def of_service(service: str) -> list[Metric]:
    return [m for m in METRICS if service in m.services]


def base_name(series: str) -> str:
    """The metric a PromQL series name belongs to: `x_bucket` -> `x` for histogram `x`."""
    histograms = {m.name for m in METRICS if m.type == "histogram"}
    for suffix in _HISTOGRAM_SUFFIXES:
        if series.endswith(suffix) and series[: -len(suffix)] in histograms:
            return series[: -len(suffix)]
    return series


def markdown_table() -> str:
    rows = ["| Metric | Type | Service | Labels | Meaning |", "|---|---|---|---|---|"]
    for m in METRICS:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "-"
        rows.append(f"| `{m.name}` | {m.type} | {', '.join(m.services)} | {labels} | {m.meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
