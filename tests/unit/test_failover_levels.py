"""Failover (services/router/failover/levels.py): L1 isolation, L2 admission, L3 plans, Saturated."""

from __future__ import annotations

import pytest

from mesh.errors import Unavailable
from services.router.failover import (
    BreakerConfig,
    BreakerState,
    Failover,
    FailoverConfig,
    Saturated,
)
from services.router.replicas import Replica

FULL, INT8, TINY = "smollm2-135m", "smollm2-135m-int8", "tiny"
CHAIN = {FULL: (INT8, 0.8), INT8: (TINY, 0.5)}


def rep(rid: str, model: str = FULL, healthy: bool = True, waiting: int = 0) -> Replica:
    r = Replica(rid, f"{rid}:1", model=model, healthy=healthy)
    r.waiting = waiting
    return r


def failover(**kwargs: object) -> Failover:
    defaults: dict[str, object] = {
        "replica": BreakerConfig(failure_threshold=2, open_s=5.0, probes=1),
        "model": BreakerConfig(failure_threshold=2, open_s=8.0, probes=1),
        "fallbacks": CHAIN,
    }
    return Failover(FailoverConfig(**{**defaults, **kwargs}))  # type: ignore[arg-type]


def fail(f: Failover, replica: Replica, now: float, times: int = 2) -> None:
    """Open the replica's breaker (failure_threshold=2) at `now`."""
    for _ in range(times):
        attempt = f.start(replica, now)
        assert attempt is not None
        f.record(attempt, now, ok=False)


def ids(replicas: list[Replica]) -> list[str]:
    return [r.replica_id for r in replicas]


# -- L1 ---------------------------------------------------------------------------------
def test_unhealthy_replicas_are_not_admitted() -> None:
    f = failover()
    pool = [rep("a"), rep("b", healthy=False), rep("c")]
    plan = f.plan(FULL, pool, 0.0)
    assert (plan.model, ids(plan.candidates), plan.degraded, plan.confidence, plan.why) == (
        FULL, ["a", "c"], False, 1.0, "")
    assert f.refusal(pool[1], 0.0) == "unhealthy"


def test_isolation_is_at_once_and_ends_with_a_health_check_sent_after_it() -> None:
    f = failover()
    pool = [rep("a"), rep("b")]
    f.isolate("a", 10.0, "stream failed: connection refused")
    assert ids(f.plan(FULL, pool, 10.0).candidates) == ["b"]
    assert f.isolation("a") == "stream failed: connection refused" and f.refusal(pool[0], 10.0) == "isolated"
    f.health_checked("a", True, checked_at=9.5)      # sent before the failure: proves nothing
    f.health_checked("a", False, checked_at=10.5)    # still failing
    assert ids(f.plan(FULL, pool, 11.0).candidates) == ["b"]
    f.health_checked("a", True, checked_at=11.0)
    assert f.isolation("a") is None and ids(f.plan(FULL, pool, 11.0).candidates) == ["a", "b"]


def test_a_recovered_replica_comes_back_only_when_its_breaker_allows() -> None:
    f = failover()
    pool = [rep("a"), rep("b")]
    fail(f, pool[0], 0.0)
    f.isolate("a", 0.0, "device error")
    f.health_checked("a", True, checked_at=1.0)
    assert ids(f.plan(FULL, pool, 1.0).candidates) == ["b"] and f.refusal(pool[0], 1.0) == "open"
    assert ids(f.plan(FULL, pool, 5.0).candidates) == ["a", "b"]      # half-open: a probe may go


# -- L2 ---------------------------------------------------------------------------------
def test_an_open_breaker_sends_requests_elsewhere() -> None:
    f = failover()
    pool = [rep("a"), rep("b")]
    fail(f, pool[0], 0.0)
    assert f.states(0.0) == {"a": BreakerState.OPEN}
    assert f.replica_breaker("a").reason == "2 consecutive failures"
    assert ids(f.plan(FULL, pool, 4.9).candidates) == ["b"]


def test_a_half_open_replica_is_planned_for_only_as_many_requests_as_it_has_probes() -> None:
    f = failover(replica=BreakerConfig(failure_threshold=2, open_s=5.0, probes=2))
    pool = [rep("a"), rep("b")]
    fail(f, pool[0], 0.0)
    # Four concurrent requests at 5.0, each planning then starting on "a" if it may.
    started = []
    for _ in range(4):
        plan = f.plan(FULL, pool, 5.0)
        if pool[0] in plan.candidates:
            attempt = f.start(pool[0], 5.0)
            assert attempt is not None and attempt.granted.probe
            started.append(attempt)
    assert len(started) == 2 and f.refusal(pool[0], 5.0) == "probing"
    assert f.start(pool[0], 5.0) is None             # a request that planned before the others started
    f.record(started[0], 6.0, ok=True)
    f.record(started[1], 6.5, ok=True)
    assert f.states(6.5) == {"a": BreakerState.CLOSED} and ids(f.plan(FULL, pool, 6.5).candidates) == ["a", "b"]


def test_a_replica_with_a_long_engine_queue_is_saturated() -> None:
    f = failover(max_queued=4)
    pool = [rep("a", waiting=5), rep("b", waiting=4)]
    assert ids(f.plan(FULL, pool, 0.0).candidates) == ["b"] and f.refusal(pool[0], 0.0) == "saturated"
    assert ids(failover(max_queued=None).plan(FULL, pool, 0.0).candidates) == ["a", "b"]


def test_by_default_a_replica_is_saturated_only_at_the_engines_own_bound() -> None:
    f = failover()                                   # max_queued None: the engine's max_waiting decides
    full, room, unknown = rep("a", waiting=256), rep("b", waiting=255), rep("c", waiting=5000)
    full.max_waiting = room.max_waiting = 256
    assert f.refusal(full, 0.0) == "saturated" and f.refusal(room, 0.0) == ""
    assert f.refusal(unknown, 0.0) == ""             # an engine that reports no bound is never shed here
    # 64 streams on a 64-row batch plus a few queued: nowhere near shedding (a7f9686 shed past 32 queued)
    busy = rep("d", waiting=40)
    busy.max_waiting = 256
    assert f.refusal(busy, 0.0) == ""


def test_the_requests_failed_replicas_are_excluded() -> None:
    f = failover()
    pool = [rep("a"), rep("b"), rep("c")]
    assert ids(f.plan(FULL, pool, 0.0, exclude={"a", "c"}).candidates) == ["b"]


def test_saturated_carries_the_soonest_half_open_time_in_whole_seconds() -> None:
    f = failover(fallbacks={})
    pool = [rep("a"), rep("b")]
    fail(f, pool[0], 0.0)                        # half-open at 5
    fail(f, pool[1], 1.0)                        # half-open at 6
    with pytest.raises(Saturated) as caught:
        f.plan(FULL, pool, 2.2)
    assert caught.value.retry_after_s == 3       # ceil(5 - 2.2)
    assert caught.value.detail == f"{FULL}: 2 open"
    assert isinstance(caught.value, Unavailable) and "retry after 3 s" in caught.value.message
    with pytest.raises(Saturated) as caught:
        f.plan(FULL, pool, 4.9)
    assert caught.value.retry_after_s == 1       # clamped up to 1 s


def test_retry_after_is_clamped_and_has_a_default_when_no_clock_tells() -> None:
    f = failover(fallbacks={}, replica=BreakerConfig(failure_threshold=1, open_s=100.0, max_open_s=100.0))
    pool = [rep("a")]
    fail(f, pool[0], 0.0, times=1)
    with pytest.raises(Saturated) as caught:
        f.plan(FULL, pool, 0.0)
    assert caught.value.retry_after_s == 30      # clamped down
    with pytest.raises(Saturated) as caught:
        f.plan(FULL, [rep("a", healthy=False)], 0.0)
    assert caught.value.retry_after_s == 5 and caught.value.detail == f"{FULL}: 1 unhealthy"
    with pytest.raises(Saturated) as caught:
        f.plan(FULL, [], 0.0)
    assert caught.value.retry_after_s == 5 and caught.value.detail == f"{FULL}: no replica"


def test_a_queue_that_would_outlast_the_requests_deadline_is_late() -> None:
    """queued / finished-per-second is the expected wait; a request with less time left is refused there
    (and sent to a shorter queue), not queued to time out."""
    f = failover(fallbacks={})
    long, short = rep("a", waiting=40), rep("b", waiting=4)
    long.qps = short.qps = 2.0                       # 20 s and 2 s of queue
    assert f.queue_wait_s(long) == 20.0 and f.refusal(long, 0.0, deadline_s=5.0) == "late"
    assert f.refusal(long, 0.0, deadline_s=30.0) == "" and f.refusal(long, 0.0) == ""   # no deadline: no limit
    assert ids(f.plan(FULL, [long, short], 0.0, deadline_s=5.0).candidates) == ["b"]
    idle = rep("c", waiting=40)                      # no request finished in its window yet: no estimate
    assert f.refusal(idle, 0.0, deadline_s=1.0) == ""
    with pytest.raises(Saturated) as caught:
        f.plan(FULL, [long], 0.0, deadline_s=5.0)
    assert caught.value.retry_after_s == 15          # until 15 s of the queue have drained
    assert "1 late (queue wait ~20 s at the shortest, beyond the request's deadline of 5 s)" in caught.value.detail


def test_excluded_or_saturated_replicas_suggest_retrying_soon() -> None:
    f = failover(fallbacks={}, max_queued=4)
    with pytest.raises(Saturated) as caught:
        f.plan(FULL, [rep("a"), rep("b", waiting=9), rep("c", healthy=False)], 0.0, exclude={"a"})
    assert caught.value.retry_after_s == 1
    assert caught.value.detail == f"{FULL}: 1 excluded, 1 saturated, 1 unhealthy"


# -- L3 ---------------------------------------------------------------------------------
def test_the_first_model_of_the_chain_with_an_admitted_replica_serves_degraded() -> None:
    f = failover()
    pool = [rep("a", healthy=False), rep("q1", INT8), rep("t1", TINY)]
    plan = f.plan(FULL, pool, 0.0)
    assert (plan.model, ids(plan.candidates), plan.degraded, plan.confidence) == (INT8, ["q1"], True, 0.8)
    assert plan.why == f"{FULL}: 1 unhealthy"
    fail(f, pool[1], 0.0)
    plan = f.plan(FULL, pool, 1.0)
    assert (plan.model, ids(plan.candidates), plan.degraded, plan.confidence) == (TINY, ["t1"], True, 0.4)
    assert plan.why == f"{FULL}: 1 unhealthy; {INT8}: 1 open"
    plan = f.plan(INT8, pool, 1.0)               # a request for the int8 model itself: confidence from there
    assert (plan.model, plan.degraded, plan.confidence) == (TINY, True, 0.5)


def test_a_models_open_breaker_sends_its_requests_down_the_chain() -> None:
    f = failover()
    pool = [rep("a"), rep("b"), rep("q1", INT8)]
    model = f.model_breaker(FULL)
    for _ in range(2):
        granted = model.acquire(0.0)
        assert granted is not None
        model.record(granted, 0.0, ok=False)
    assert f.model_states(0.0) == {FULL: BreakerState.OPEN}
    plan = f.plan(FULL, pool, 1.0)
    assert (plan.model, ids(plan.candidates), plan.degraded, plan.confidence) == (INT8, ["q1"], True, 0.8)
    assert plan.why == f"{FULL}: model breaker open (2 consecutive failures)"
    with pytest.raises(Saturated) as caught:     # no fallback replica at all
        f.plan(FULL, [rep("a")], 1.0)
    assert caught.value.retry_after_s == 7       # the model breaker half-opens at 8
    assert caught.value.detail == (f"{FULL}: model breaker open (2 consecutive failures); "
                                   f"{INT8}: no replica; {TINY}: no replica")
    assert f.plan(FULL, pool, 8.0).model == FULL   # half-open: its probe may go


def test_forget_drops_a_replicas_state() -> None:
    f = failover()
    pool = [rep("a")]
    fail(f, pool[0], 0.0)
    f.isolate("a", 0.0, "gone")
    f.forget("a")
    assert f.states(0.0) == {} and f.isolation("a") is None and ids(f.plan(FULL, pool, 0.0).candidates) == ["a"]
