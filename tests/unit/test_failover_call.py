"""Call (services/router/failover/call.py): a request's retries, budget, probes and model outcomes."""

from __future__ import annotations

import pytest

from services.router.failover import (
    Attempt,
    BreakerConfig,
    BreakerState,
    Call,
    Failover,
    FailoverConfig,
    Saturated,
)
from services.router.replicas import Replica

FULL, INT8 = "smollm2-135m", "smollm2-135m-int8"


def rep(rid: str, model: str = FULL) -> Replica:
    return Replica(rid, f"{rid}:1", model=model, healthy=True)


def failover(**kwargs: object) -> Failover:
    defaults: dict[str, object] = {
        "replica": BreakerConfig(failure_threshold=3, open_s=5.0, probes=1),
        "model": BreakerConfig(failure_threshold=1, open_s=10.0, probes=1),
        "fallbacks": {FULL: (INT8, 0.8)},
    }
    return Failover(FailoverConfig(**{**defaults, **kwargs}))  # type: ignore[arg-type]


def attempt(call: Call, pool: list[Replica], now: float) -> Attempt:
    """Plan, let a trivial policy take the first candidate, start."""
    plan = call.plan(pool, now)
    started = call.start(plan.candidates[0], now)
    assert started is not None
    return started


def test_a_failed_attempt_is_retried_on_another_replica_up_to_max_attempts() -> None:
    f = failover(max_attempts=3)
    pool = [rep("a"), rep("b"), rep("c"), rep("d")]
    call = Call(f, FULL, 0.0)
    tried = []
    while True:
        a = attempt(call, pool, 0.0)
        tried.append(a.replica_id)
        if not call.failed(a, 0.1):
            break
    assert tried == ["a", "b", "c"] and call.attempts == 3 and call.done
    assert call.failed_on == {"a", "b", "c"}
    with pytest.raises(RuntimeError):
        call.plan(pool, 0.2)


def test_when_the_request_has_failed_everywhere_it_is_saturated() -> None:
    f = failover(fallbacks={})
    pool = [rep("a"), rep("b")]
    call = Call(f, FULL, 0.0)
    assert call.failed(attempt(call, pool, 0.0), 0.0)
    assert call.failed(attempt(call, pool, 0.0), 0.0)
    with pytest.raises(Saturated) as caught:
        call.plan(pool, 0.0)
    assert caught.value.retry_after_s == 1 and caught.value.detail == f"{FULL}: 2 excluded"
    assert call.done and f.model_states(0.0) == {FULL: BreakerState.OPEN}   # the request failed on FULL


def test_retries_of_a_burst_of_failures_stop_at_the_shared_budget() -> None:
    f = failover(retry_ratio=0.2, retry_min_per_s=0.1, retry_window_s=10.0)
    pool = [rep(f"r{i}") for i in range(10)]
    calls = [Call(f, FULL, 0.0) for _ in range(20)]
    first = [call.start(pool[i % 10], 0.0) for i, call in enumerate(calls)]
    retried = [call.failed(a, 0.0) for call, a in zip(calls, first, strict=True) if a is not None]
    assert retried.count(True) == 5              # 0.2 * 20 requests + 0.1/s * 10 s
    assert f.budget.refused == 15
    late = Call(f, FULL, 10.0)                   # a window later the budget is back
    assert late.failed(attempt(late, pool, 10.0), 10.0)


def test_a_request_that_succeeds_on_retry_is_a_success_for_its_model() -> None:
    f = failover()
    pool = [rep("a"), rep("b")]
    call = Call(f, FULL, 0.0)
    assert call.failed(attempt(call, pool, 0.0), 0.1)
    call.succeeded(attempt(call, pool, 0.2), 0.5, latency_s=0.3)
    # failure_threshold=1 for models: one failed request would have opened it.
    assert f.model_states(0.5) == {FULL: BreakerState.CLOSED}
    assert f.model_breaker(FULL).window.count(0.5) == 1
    assert f.replica_breaker("a").window.error_rate(0.5) == 1.0


def test_a_failed_request_opens_the_model_breaker_and_the_next_goes_down_the_chain() -> None:
    f = failover(max_attempts=1)
    pool = [rep("a"), rep("b"), rep("q1", INT8)]
    call = Call(f, FULL, 0.0)
    assert not call.failed(attempt(call, pool, 0.0), 1.0)
    assert f.model_states(1.0) == {FULL: BreakerState.OPEN}
    plan = Call(f, FULL, 2.0).plan(pool, 2.0)
    assert (plan.model, plan.degraded, plan.confidence) == (INT8, True, 0.8)


def test_a_half_open_model_takes_as_many_requests_as_it_has_probes() -> None:
    f = failover()
    pool = [rep("a"), rep("b"), rep("q1", INT8)]
    granted = f.model_breaker(FULL).acquire(0.0)
    assert granted is not None
    f.model_breaker(FULL).record(granted, 0.0, ok=False)       # open until 10
    probe, other = Call(f, FULL, 10.0), Call(f, FULL, 10.0)
    assert probe.plan(pool, 10.0).model == FULL
    assert other.plan(pool, 10.0).model == INT8                # the one probe is out
    first = probe.start(pool[0], 10.0)
    assert first is not None and probe.failed(first, 10.5)     # the probe's own retry stays on FULL ...
    retry = probe.plan(pool, 10.5)
    assert (retry.model, [r.replica_id for r in retry.candidates]) == (FULL, ["b"])
    second = probe.start(retry.candidates[0], 10.5)
    assert second is not None
    probe.succeeded(second, 11.0)                              # ... and its success closes the model breaker
    assert f.model_states(11.0) == {FULL: BreakerState.CLOSED, INT8: BreakerState.CLOSED}
    assert Call(f, FULL, 11.0).plan(pool, 11.0).model == FULL


def test_a_cancelled_probe_is_no_outcome_and_frees_its_slot() -> None:
    f = failover()
    pool = [rep("a"), rep("b")]
    for _ in range(3):
        a = f.start(pool[0], 0.0)
        assert a is not None
        f.record(a, 0.0, ok=False)                             # "a" open until 5
    call = Call(f, FULL, 5.0)
    assert call.plan(pool, 5.0).candidates == pool
    probe = call.start(pool[0], 5.0)
    assert probe is not None and probe.granted.probe
    assert Call(f, FULL, 5.0).plan(pool, 5.0).candidates == [pool[1]]
    call.cancelled(probe, 6.0)
    assert f.states(6.0) == {"a": BreakerState.HALF_OPEN}
    assert f.model_breaker(FULL).window.count(6.0) == 0        # the model judged nothing either
    assert Call(f, FULL, 6.0).plan(pool, 6.0).candidates == pool


def test_a_mid_stream_failure_is_a_failed_attempt_like_any_other() -> None:
    f = failover()
    pool = [rep("a"), rep("b")]
    call = Call(f, FULL, 0.0)
    streaming = attempt(call, pool, 0.0)
    f.isolate(streaming.replica_id, 3.0, "stream broke: connection reset")   # the engine died mid-stream
    assert call.failed(streaming, 3.0, latency_s=0.2)
    resumed = call.plan(pool, 3.0)
    assert [r.replica_id for r in resumed.candidates] == ["b"] and not resumed.degraded


def test_close_in_a_finally_gives_back_what_an_odd_ending_held() -> None:
    f = failover()
    pool = [rep("a")]
    for _ in range(3):
        a = f.start(pool[0], 0.0)
        assert a is not None
        f.record(a, 0.0, ok=False)                             # "a" open until 5
    call = Call(f, FULL, 5.0)
    probe = attempt(call, pool, 5.0)
    assert probe.granted.probe and f.refusal(pool[0], 5.0) == "probing"
    with pytest.raises(RuntimeError):
        call.start(pool[0], 5.0)                               # one attempt at a time
    call.close(5.5)                                            # e.g. a bug raised mid-relay
    assert call.done and f.refusal(pool[0], 5.5) == ""
    assert f.model_breaker(FULL).window.count(5.5) == 0
    done = Call(f, FULL, 6.0)
    done.succeeded(attempt(done, pool, 6.0), 6.5)
    done.close(7.0)                                            # a call that ended is untouched
    assert f.states(7.0) == {"a": BreakerState.CLOSED} and f.model_breaker(FULL).window.count(7.0) == 1


def test_a_busy_replica_refusing_is_no_failure_for_either_breaker() -> None:
    f = failover(fallbacks={})
    pool = [rep("a"), rep("b")]
    for i in range(5):                            # five requests, each refused by a and b (their queues full)
        call = Call(f, FULL, float(i))
        first = attempt(call, pool, float(i))
        assert call.refused(first, float(i)) and call.failed_on == {first.replica_id}
        second = attempt(call, pool, float(i))
        assert second.replica_id != first.replica_id
        assert call.refused(second, float(i))
        with pytest.raises(Saturated):            # every replica busy: 503 with a retry-after, nothing opened
            call.plan(pool, float(i))
    assert f.model_states(5.0) == {FULL: BreakerState.CLOSED}
    assert all(f.replica_breaker(r).state(5.0) is BreakerState.CLOSED for r in ("a", "b"))
    assert f.replica_breaker("a").window.count(5.0) == 0 and f.model_breaker(FULL).window.count(5.0) == 0
    call = Call(f, FULL, 6.0)                     # the next request is served as if nothing happened
    call.succeeded(attempt(call, pool, 6.0), 6.5, latency_s=0.2)
    assert f.model_states(6.5) == {FULL: BreakerState.CLOSED}


def test_refusals_stop_at_max_attempts() -> None:
    f = failover(max_attempts=2)
    pool = [rep("a"), rep("b"), rep("c")]
    call = Call(f, FULL, 0.0)
    assert call.refused(attempt(call, pool, 0.0), 0.0)
    assert not call.refused(attempt(call, pool, 0.0), 0.0) and call.done
