"""The engine's request figures kept out of its servicer: the load reports' window (stats.RecentLoad) and a
Generate call's metrics (metrics.RequestMetrics), read back from the Prometheus registry."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.engine import metrics
from services.engine.core.request import StepOutput
from services.engine.stats import LoadFigures, RecentLoad, Timing


def test_recent_load_counts_the_window_only() -> None:
    recent = RecentLoad(window_s=10.0)
    assert recent.figures(0.0) == LoadFigures(0.0, 0.0, 0.0, 0.0)
    recent.generated(1.0, [StepOutput("a", (1, 2)), StepOutput("b", (3,))])
    recent.generated(12.0, [StepOutput("a", (4, 5, 6))])
    for end, latency in [(2.0, 9.0), (5.0, 0.5), (6.0, 0.1), (7.0, 0.3)]:
        recent.finished(end, latency)
    # At 14: the outputs of 1.0 and the request ended at 2.0 are out of the window.
    assert recent.figures(14.0) == LoadFigures(0.3, 300.0, 500.0, 0.3)


def _value(name: str, replica: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"replica": replica, **labels}) or 0.0


def test_a_calls_metrics_count_its_tokens_first_token_and_outcome() -> None:
    replica = metrics.ReplicaMetrics("stats-test")
    call = replica.request("an-adapter")
    assert _value("infermesh_engine_lora_requests_total", "stats-test", adapter="an-adapter") == 1
    call.generated(0)                           # a message with no tokens (prompt logprobs alone): no first token
    assert _value("infermesh_engine_time_to_first_token_seconds_count", "stats-test") == 0
    call.generated(2)
    call.generated(3)
    assert _value("infermesh_engine_generated_tokens_total", "stats-test") == 5
    assert _value("infermesh_engine_time_to_first_token_seconds_count", "stats-test") == 1
    call.ended("stop", 5)
    assert _value("infermesh_engine_time_per_output_token_seconds_count", "stats-test") == 1
    assert replica.recent.figures(call.started).qps == pytest.approx(0.1)
    call.closed(Timing(arrival_ns=1_000_000_000, scheduled_ns=1_250_000_000))
    assert _value("infermesh_engine_requests_total", "stats-test", finish_reason="stop") == 1
    assert _value("infermesh_engine_queue_wait_seconds_sum", "stats-test") == pytest.approx(0.25)


def test_a_call_that_never_ends_counts_as_cancelled_and_a_refused_one_as_rejected() -> None:
    replica = metrics.ReplicaMetrics("stats-test-2")
    replica.request().closed(None)
    refused = replica.request()
    refused.outcome = "rejected"
    refused.closed(Timing(arrival_ns=1))        # never scheduled: no queue wait
    assert _value("infermesh_engine_requests_total", "stats-test-2", finish_reason="cancelled") == 1
    assert _value("infermesh_engine_requests_total", "stats-test-2", finish_reason="rejected") == 1
    assert _value("infermesh_engine_queue_wait_seconds_count", "stats-test-2") == 0
    assert _value("infermesh_engine_time_per_output_token_seconds_count", "stats-test-2") == 0
