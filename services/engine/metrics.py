"""Prometheus metrics of one engine replica (served on --metrics-port).

ReplicaMetrics binds them to the replica's label; a Generate call's own figures (its tokens, time to
first token, time per output token, outcome, queue wait, and its latency for the load reports) are
observed by its RequestMetrics, which the servicer tells what the stream saw.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.engine.runtime.grammar_limits import REFUSALS
from services.engine.stats import RecentLoad

if TYPE_CHECKING:
    from services.engine.runtime.plan import ExecutionPlan  # only named here: the metrics need no torch
    from services.engine.stats import Timing

LABELS = ["replica"]
RUNNING = Gauge("infermesh_engine_requests_running", "Requests in the running batch", LABELS)
WAITING = Gauge("infermesh_engine_requests_waiting", "Requests waiting for admission", LABELS)
KV_USED = Gauge("infermesh_engine_kv_blocks_used", "KV cache blocks in use or cached", LABELS)
KV_FREE = Gauge("infermesh_engine_kv_blocks_free", "KV cache blocks free or evictable", LABELS)
PREFIX_QUERIED = Counter("infermesh_engine_prefix_query_tokens_total", "Prompt tokens looked up in the prefix cache",
                         LABELS)
PREFIX_HIT = Counter("infermesh_engine_prefix_hit_tokens_total", "Prompt tokens served from the prefix cache", LABELS)
PREEMPTIONS = Counter("infermesh_engine_preemptions_total", "Requests preempted for lack of KV blocks", LABELS)
DRAFTED = Counter("infermesh_engine_draft_tokens_total",
                  "Speculative draft tokens verified (prompt lookup or the draft model)", LABELS)
ACCEPTED = Counter("infermesh_engine_draft_accepted_tokens_total", "Of the draft tokens verified, those accepted",
                   LABELS)
SPEEDUP = Gauge("infermesh_engine_draft_speedup",
                "The draft model's last drafted step: its tokens a second (drafting included) over a plain decode "
                "step's of the same size; drafting stops at sizes where this stays below 1", LABELS)
# A constrained request's grammar: cached (compiled before), compiled, or why it was refused
# (services/engine/runtime/grammar_limits.py REFUSALS).  Refusals are values of this label, not a metric of their
# own, so the dashboard's structured-output panel shows them beside the compiles they limit.
GRAMMAR_OUTCOMES = ("cached", "compiled", *REFUSALS)
CONSTRAINED = Counter("infermesh_engine_constrained_requests_total",
                      "Requests with a structured-output constraint, by grammar: cached, compiled, or refused "
                      "(invalid, rate_limited, busy, timeout, remembered)", [*LABELS, "grammar"])
STEP = Histogram("infermesh_engine_step_seconds", "Duration of one engine step", LABELS,
                 buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
STEP_TOKENS = Counter("infermesh_engine_step_tokens_total", "Tokens computed (prefill and decode)", LABELS)
GENERATED = Counter("infermesh_engine_generated_tokens_total", "Tokens generated; rate() gives tokens/s", LABELS)
TTFT = Histogram("infermesh_engine_time_to_first_token_seconds", "Arrival to first generated token", LABELS,
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
QUEUE_WAIT = Histogram("infermesh_engine_queue_wait_seconds", "Arrival to the first step that ran the request",
                       LABELS, buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
BATCH = Histogram("infermesh_engine_batch_size", "Sequences in one engine step (decode rows and prefill chunks)",
                  LABELS, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
REQUESTS = Counter("infermesh_engine_requests_total",
                   "Generate requests ended, by outcome: stop, length, abort, error, cancelled, rejected",
                   ["replica", "finish_reason"])
TPOT = Histogram("infermesh_engine_time_per_output_token_seconds", "Mean gap between generated tokens", LABELS,
                 buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1))
LORA_ADAPTERS = Gauge("infermesh_engine_lora_adapters", "LoRA adapters loaded (LoadAdapter)", LABELS)
LORA_REQUESTS = Counter("infermesh_engine_lora_requests_total", "Generate requests that ran with a LoRA adapter, "
                        "by adapter", ["replica", "adapter"])
LORA_LOAD = Histogram("infermesh_engine_lora_load_seconds", "Time to read a LoRA adapter's folder (LoadAdapter)",
                      LABELS, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


def count_adapter_request(replica: str, adapter: str) -> None:
    """A Generate request named `adapter` ("": the base model, not counted)."""
    if adapter:
        LORA_REQUESTS.labels(replica, adapter).inc()


PLAN_LABELS = ("device", "dtype", "matmul", "attention", "ops", "graphs", "matmul_large", "split_rows", "kv_dtype")
PLAN = Gauge("infermesh_engine_plan_info", "The replica's execution plan (runtime/plan.py) as labels; 1",
             ["replica", *PLAN_LABELS])


SHARED_CACHE_EVENTS = ("fetched", "rejected", "published", "dropped")


class SharedCacheCollector:
    """The shared KV cache's block counters, read from each replica's RemoteCache.stats and Outbox at
    scrape time (the publisher updates them between steps and while the engine idles)."""

    def __init__(self) -> None:
        self.sources: dict[str, tuple[Any, Any]] = {}       # replica -> (RemoteCache, Outbox)

    def _families(self) -> tuple[CounterMetricFamily, CounterMetricFamily]:
        return (CounterMetricFamily("infermesh_engine_shared_cache_blocks",
                                    "KV blocks exchanged with the shared cache, by event: fetched (staged on "
                                    "requests), rejected (another layout), published (stored), dropped (never "
                                    "sent: the cache down or slow, or the outbox full)", labels=["replica", "event"]),
                CounterMetricFamily("infermesh_engine_shared_cache_errors",
                                    "Failed calls to the shared KV cache", labels=["replica"]))

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        blocks, errors = self._families()
        for replica, (remote, outbox) in list(self.sources.items()):
            s = remote.stats
            dropped = s.dropped_blocks + (outbox.dropped_blocks if outbox is not None else 0)
            for event, n in zip(SHARED_CACHE_EVENTS, (s.fetched_blocks, s.rejected_blocks, s.published_blocks,
                                                      dropped), strict=True):
                blocks.add_metric([replica, event], n)
            errors.add_metric([replica], s.errors)
        yield blocks
        yield errors


SHARED_CACHE = SharedCacheCollector()
REGISTRY.register(SHARED_CACHE)


class TenantCollector:
    """Fair scheduling's figures per tenant, read from each replica's EngineStats at scrape time (the step
    thread replaces `tenants` whole after every step; its token counts are copied in one go)."""

    def __init__(self) -> None:
        self.sources: dict[str, Any] = {}       # replica -> EngineStats

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily, CounterMetricFamily,
                                 CounterMetricFamily, CounterMetricFamily]:
        labels = ["replica", "tenant"]
        return (GaugeMetricFamily("infermesh_engine_tenant_queued", "Requests waiting for admission, by tenant "
                                  "(\"common\": requests that name none)", labels=labels),
                GaugeMetricFamily("infermesh_engine_tenant_running", "Requests holding KV blocks, by tenant",
                                  labels=labels),
                CounterMetricFamily("infermesh_engine_tenant_tokens", "Tokens computed (prefill and decode), by "
                                    "tenant; rate() gives each tenant's share", labels=labels),
                CounterMetricFamily("infermesh_engine_paused_rows", "Running requests left out of a step (KV kept): "
                                    "their tenant's share spent, or a higher class took the row", labels=["replica"]),
                CounterMetricFamily("infermesh_engine_interrupted_steps", "Steps of batch-class rows given up between "
                                    "layers for an interactive request (their rows run again)", labels=["replica"]),
                CounterMetricFamily("infermesh_engine_capped_steps", "Steps that left requests out because their "
                                    "rows were capped for a light tenant's share (--fair-slowdown)",
                                    labels=["replica"]))

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        queued, running, tokens, paused, interrupted, capped = self._families()
        for replica, stats in list(self.sources.items()):
            for load in stats.tenants:
                queued.add_metric([replica, load.tenant or "common"], load.waiting)
                running.add_metric([replica, load.tenant or "common"], load.running)
            for tenant, n in stats.tenant_tokens.copy().items():
                tokens.add_metric([replica, tenant or "common"], n)
            paused.add_metric([replica], stats.paused)
            interrupted.add_metric([replica], stats.interrupted)
            capped.add_metric([replica], stats.capped)
        yield from (queued, running, tokens, paused, interrupted, capped)


TENANTS = TenantCollector()
REGISTRY.register(TENANTS)


class ReplicaMetrics:
    """The metrics above, bound to one replica's label, plus the counters' last readings."""

    def __init__(self, replica: str):
        self.running, self.waiting = RUNNING.labels(replica), WAITING.labels(replica)
        self.kv_used, self.kv_free = KV_USED.labels(replica), KV_FREE.labels(replica)
        self.queried, self.hit = PREFIX_QUERIED.labels(replica), PREFIX_HIT.labels(replica)
        self.preemptions = PREEMPTIONS.labels(replica)
        self.drafted, self.accepted = DRAFTED.labels(replica), ACCEPTED.labels(replica)
        self.speedup = SPEEDUP.labels(replica)
        self.step, self.step_tokens = STEP.labels(replica), STEP_TOKENS.labels(replica)
        self.generated = GENERATED.labels(replica)
        self.ttft, self.tpot = TTFT.labels(replica), TPOT.labels(replica)
        self.queue_wait, self.batch = QUEUE_WAIT.labels(replica), BATCH.labels(replica)
        self.replica = replica
        self.recent = RecentLoad()     # the load reports' window: requests finished, tokens generated
        self._constrained = {g: CONSTRAINED.labels(replica, g) for g in GRAMMAR_OUTCOMES}
        self._seen = (0, 0, 0, 0, 0)  # prefix queries, hits, preemptions, drafted, accepted already counted
        self._plan: tuple[str, ...] = ()

    def request(self, adapter: str = "") -> RequestMetrics:
        """A Generate call's figures, from now (its start); `adapter`: the LoRA adapter it named, if any."""
        count_adapter_request(self.replica, adapter)
        return RequestMetrics(self)

    def constrained(self, grammar: str) -> None:
        """One constrained request: its grammar's GRAMMAR_OUTCOMES value."""
        self._constrained[grammar].inc()

    # One argument per series it sets (the scheduler's and block manager's numbers after a step): flat on purpose.
    def observe_step(self, running: int, waiting: int, used: int, free: int, queries: int, hits: int,  # noqa: PLR0913
                     preemptions: int, step_s: float, step_tokens: int, batch_size: int = 0, drafted: int = 0,
                     accepted: int = 0, speedup: float = 0.0) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(used)
        self.kv_free.set(free)
        seen_q, seen_h, seen_p, seen_d, seen_a = self._seen
        self.queried.inc(queries - seen_q)
        self.hit.inc(hits - seen_h)
        self.preemptions.inc(preemptions - seen_p)
        self.drafted.inc(drafted - seen_d)
        self.accepted.inc(accepted - seen_a)
        self._seen = (queries, hits, preemptions, drafted, accepted)
        if speedup:
            self.speedup.set(speedup)
        if step_tokens:
            self.step.observe(step_s)
            self.step_tokens.inc(step_tokens)
        if batch_size:
            self.batch.observe(batch_size)

    def finished(self, outcome: str) -> None:
        REQUESTS.labels(self.replica, outcome).inc()

    def watch_shared_cache(self, remote: Any, outbox: Any) -> None:
        """Export this replica's shared-cache counters (remote: RemoteCache, outbox: its Outbox) until close()."""
        SHARED_CACHE.sources[self.replica] = (remote, outbox)

    def watch_tenants(self, stats: Any) -> None:
        """Export this replica's per-tenant figures (stats: its EngineStats) until close()."""
        TENANTS.sources[self.replica] = stats

    def set_plan(self, plan: ExecutionPlan) -> None:
        """Export the replica's ExecutionPlan as infermesh_engine_plan_info{replica, device, ...} = 1."""
        labels = plan.labels()
        self._plan = (self.replica, *(labels[name] for name in PLAN_LABELS))
        PLAN.labels(*self._plan).set(1)

    def close(self) -> None:
        SHARED_CACHE.sources.pop(self.replica, None)
        TENANTS.sources.pop(self.replica, None)
        if self._plan:
            PLAN.remove(*self._plan)
            self._plan = ()


class RequestMetrics:
    """One Generate call's figures, as its stream saw them: tokens generated, time to first token from the
    call's start (a grammar's compile and a shared-cache fetch included), mean time per output token, its
    latency (into the load reports' window) and its outcome (requests_total: "cancelled", the caller went
    away, unless told otherwise), counted when the call closes."""

    def __init__(self, replica: ReplicaMetrics):
        self._replica = replica
        self.started = time.monotonic()
        self.first_token_at = 0.0
        self.outcome = "cancelled"

    def generated(self, tokens: int) -> None:
        """One message's tokens, about to be sent."""
        if tokens:
            self._replica.generated.inc(tokens)
            if not self.first_token_at:
                self.first_token_at = time.monotonic()
                self._replica.ttft.observe(self.first_token_at - self.started)

    def ended(self, outcome: str, produced: int) -> None:
        """The last message, about to be sent: the request ended with `outcome` (its finish reason) after
        `produced` tokens generated here."""
        self.outcome = outcome
        if produced > 1:
            self._replica.tpot.observe((time.monotonic() - self.first_token_at) / (produced - 1))
        self._replica.recent.finished(time.monotonic(), time.monotonic() - self.started)

    def closed(self, timing: Timing | None) -> None:
        """The call is over (completed, failed, refused or cancelled); `timing`: the engine's phase timings."""
        self._replica.finished(self.outcome)
        if timing is not None and timing.scheduled_ns:
            self._replica.queue_wait.observe((timing.scheduled_ns - timing.arrival_ns) / 1e9)
