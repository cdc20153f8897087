"""Attempts (services/router/failover/attempts.py): a request's tries, driven by hand with a fake clock
(plain floats), in-memory replicas and a policy that takes the first candidate: no sockets, no engines."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import pytest

from services.router.failover import BreakerConfig, BreakerState, Call, Failover, FailoverConfig, Pass, Saturated
from services.router.failover.attempts import (
    Attempts,
    Busy,
    Fail,
    FailedOver,
    Failure,
    FinishAtLength,
    Finished,
    Isolated,
    Prepare,
    Try,
)
from services.router.policies import Decision, RouteRequest
from services.router.replicas import Replica

FULL, INT8 = "smollm2-135m", "smollm2-135m-int8"


def rep(rid: str, model: str = FULL, healthy: bool = True) -> Replica:
    return Replica(rid, f"{rid}:1", model=model, healthy=healthy)


def failover(**kwargs: object) -> Failover:
    defaults: dict[str, object] = {
        "replica": BreakerConfig(failure_threshold=3, open_s=5.0, probes=1),
        "model": BreakerConfig(failure_threshold=1, open_s=10.0, probes=1),
        "fallbacks": {FULL: (INT8, 0.8)},
    }
    return Failover(FailoverConfig(**{**defaults, **kwargs}))  # type: ignore[arg-type]


def engine_failed(rid: str, code: str = "UNAVAILABLE", isolate: bool = True) -> Failure:
    """What relay.EngineFailed says of an engine that answered `code`."""
    reason = f"failed: {code}: engine went away"
    return Failure(rid, reason, f"engine {rid} {reason}", code == "RESOURCE_EXHAUSTED", isolate)


class Mesh:
    """The dispatcher's side, in memory: the pool (Dispatcher._pool's model filter) and a policy that
    takes the first candidate; both record what they were asked."""

    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas
        self.pools: list[tuple[str | None, set[str]]] = []
        self.picks: list[tuple[list[str], str, float]] = []

    def pool(self, streamed: str | None, failed: Collection[str]) -> list[Replica]:
        self.pools.append((streamed, set(failed)))
        return [r for r in self.replicas if streamed is None or r.model == streamed]

    def pick(self, candidates: Sequence[Replica], route: RouteRequest, now: float) -> Decision:
        self.picks.append(([r.replica_id for r in candidates], route.model, now))
        return Decision(candidates[0], "balance")

    def attempts(self, f: Failover, now: float = 0.0, streamed: int = 0, max_tokens: int = 0) -> Attempts:
        return Attempts(Call(f, FULL, now), self.pool, self.pick, RouteRequest(FULL), streamed, max_tokens)


def tried(step: object) -> tuple[str, str, str, int]:
    assert isinstance(step, Try), step
    return step.replica.replica_id, step.plan.model, step.reason, step.failover_attempts


def test_a_first_try_that_succeeds_finishes_with_its_time_to_first_token() -> None:
    f, mesh = failover(), Mesh([rep("a"), rep("b")])
    attempts = mesh.attempts(f, 1.0)
    step = attempts.next(1.0)
    assert tried(step) == ("a", FULL, "balance", 0)
    assert mesh.pools == [(None, set())] and mesh.picks == [(["a", "b"], FULL, 1.0)]
    attempts.replied(1.25)
    attempts.replied(1.5)                          # only the first message times the first token
    attempts.succeeded(2.0)
    assert isinstance(step, Try)
    assert attempts.next(2.0) == Finished(step.plan, 0.25) == attempts.next(3.0)
    assert attempts.plans == 1 and attempts.call.done
    assert f.model_states(2.0) == {FULL: BreakerState.CLOSED} and f.model_breaker(FULL).window.count(2.0) == 1
    assert f.replica_breaker("a").window.error_rate(2.0) == 0.0


def test_an_engine_dying_mid_stream_fails_over_to_the_next_replica_of_the_model() -> None:
    f, mesh = failover(), Mesh([rep("a"), rep("b"), rep("q1", INT8)])
    attempts = mesh.attempts(f)
    assert tried(attempts.next(0.0)) == ("a", FULL, "balance", 0)
    attempts.replied(0.5)
    failure = engine_failed("a")
    events = attempts.failed(failure, 3, 1.0)
    assert events == [Isolated("a", "failed: UNAVAILABLE: engine went away"),
                      FailedOver("a", "engine a failed: UNAVAILABLE: engine went away", 3)]
    assert f.isolation("a") == "failed: UNAVAILABLE: engine went away"
    assert tried(attempts.next(1.0)) == ("b", FULL, "failover", 1)
    # The stream holds tokens: it continues on their model, without the replica it failed on.
    assert mesh.pools[-1] == (FULL, {"a"}) and mesh.picks[-1] == (["b"], FULL, 1.0)
    attempts.succeeded(2.0)
    assert isinstance(attempts.next(2.0), Finished)
    assert f.replica_breaker("a").window.error_rate(2.0) == 1.0
    assert f.model_states(2.0) == {FULL: BreakerState.CLOSED}     # served by its model, on the retry


def test_a_failure_that_does_not_isolate_leaves_the_replica_admitted_for_others() -> None:
    f, mesh = failover(), Mesh([rep("a"), rep("b")])
    attempts = mesh.attempts(f)
    attempts.next(0.0)
    stall = Failure("a", "stalled: nothing for 5 s", "engine a stalled: nothing for 5 s", False, False)
    assert attempts.failed(stall, 0, 5.0) == [FailedOver("a", "engine a stalled: nothing for 5 s", 0)]
    assert f.isolation("a") is None and f.refusal(mesh.replicas[0], 5.0) == ""
    assert tried(attempts.next(5.0)) == ("b", FULL, "failover", 1)
    assert mesh.pools[-1] == (None, {"a"})          # nothing streamed: any model of the chain may take it


def test_an_engine_dying_after_the_last_token_finishes_the_stream_at_length() -> None:
    f, mesh = failover(), Mesh([rep("a"), rep("b")])
    attempts = mesh.attempts(f, max_tokens=5)
    step = attempts.next(0.0)
    attempts.replied(0.5)
    assert attempts.failed(engine_failed("a"), 5, 1.0) == [Isolated("a", "failed: UNAVAILABLE: engine went away")]
    assert isinstance(step, Try)
    assert attempts.next(1.0) == FinishAtLength(step.replica, step.plan)
    assert attempts.plans == 1 and attempts.call.done and len(mesh.picks) == 1
    # The request succeeded on its model and its replica; the isolation stands for the next requests.
    assert f.model_breaker(FULL).window.count(1.0) == 1 and f.replica_breaker("a").window.error_rate(1.0) == 0.0
    assert f.refusal(mesh.replicas[0], 1.0) == "isolated"


def test_short_of_max_tokens_a_dead_engine_is_an_ordinary_failover() -> None:
    attempts = Mesh([rep("a"), rep("b")]).attempts(failover(), max_tokens=5)
    attempts.next(0.0)
    attempts.replied(0.5)
    assert attempts.failed(engine_failed("a", isolate=False), 4, 1.0) == [
        FailedOver("a", "engine a failed: UNAVAILABLE: engine went away", 4)]
    assert tried(attempts.next(1.0)) == ("b", FULL, "failover", 1)


def test_a_busy_replica_before_the_first_token_sends_the_request_to_another_without_its_breaker() -> None:
    f, mesh = failover(), Mesh([rep("a"), rep("b")])
    attempts = mesh.attempts(f)
    attempts.next(0.0)
    busy = engine_failed("a", "RESOURCE_EXHAUSTED", isolate=False)
    assert attempts.failed(busy, 0, 0.1) == [Busy("engine a failed: RESOURCE_EXHAUSTED: engine went away")]
    assert tried(attempts.next(0.1)) == ("b", FULL, "failover", 1)
    assert mesh.pools[-1] == (None, {"a"})
    attempts.succeeded(0.5)
    assert f.replica_breaker("a").window.count(0.5) == 0
    assert f.budget.available(0.5) == pytest.approx(10.2)       # 0.2 * 1 request + 1/s * 10 s: no retry spent
    assert f.model_breaker(FULL).window.count(0.5) == 1


def test_when_every_replica_tried_is_busy_the_request_is_unavailable() -> None:
    f, mesh = failover(max_attempts=2), Mesh([rep("a"), rep("b"), rep("c")])
    attempts = mesh.attempts(f)
    attempts.next(0.0)
    assert attempts.failed(engine_failed("a", "RESOURCE_EXHAUSTED", isolate=False), 0, 0.1) == [
        Busy("engine a failed: RESOURCE_EXHAUSTED: engine went away")]
    assert tried(attempts.next(0.1)) == ("b", FULL, "failover", 1)
    assert attempts.failed(engine_failed("b", "RESOURCE_EXHAUSTED", isolate=False), 0, 0.2) == []
    assert attempts.next(0.2) == Fail("engine b failed: RESOURCE_EXHAUSTED: engine went away; "
                                      "every replica tried is busy")
    assert attempts.call.done and f.model_states(0.2) == {FULL: BreakerState.CLOSED}
    assert f.model_breaker(FULL).window.count(0.2) == 0          # busy is no outcome for the model either


def test_resource_exhausted_after_the_first_token_is_a_failure() -> None:
    f, mesh = failover(), Mesh([rep("a"), rep("b")])
    attempts = mesh.attempts(f)
    attempts.next(0.0)
    attempts.replied(0.2)
    assert attempts.failed(engine_failed("a", "RESOURCE_EXHAUSTED", isolate=False), 1, 0.3) == [
        FailedOver("a", "engine a failed: RESOURCE_EXHAUSTED: engine went away", 1)]
    assert f.replica_breaker("a").window.error_rate(0.3) == 1.0


def test_a_spent_retry_budget_ends_the_request_unavailable() -> None:
    f, mesh = failover(retry_ratio=0.0, retry_min_per_s=0.0), Mesh([rep("a"), rep("b")])
    attempts = mesh.attempts(f)
    attempts.next(0.0)
    assert attempts.failed(engine_failed("a"), 0, 1.0) == [Isolated("a", "failed: UNAVAILABLE: engine went away")]
    assert attempts.next(1.0) == Fail("engine a failed: UNAVAILABLE: engine went away; "
                                      "no attempt or retry budget left for this request")
    assert f.budget.refused == 1 and attempts.plans == 1
    assert f.model_states(1.0) == {FULL: BreakerState.OPEN}          # the request failed on its model


def test_spent_attempts_end_the_request_unavailable_without_touching_the_budget() -> None:
    f, mesh = failover(max_attempts=2, fallbacks={}), Mesh([rep("a"), rep("b"), rep("c")])
    attempts = mesh.attempts(f)
    ends = []
    for now in (0.0, 1.0):
        ends.append(tried(attempts.next(now)))
        attempts.failed(engine_failed(ends[-1][0], isolate=False), 0, now + 0.5)
    assert [rid for rid, *_ in ends] == ["a", "b"]
    assert attempts.next(2.0) == Fail("engine b failed: UNAVAILABLE: engine went away; "
                                      "no attempt or retry budget left for this request")
    assert f.budget.refused == 0 and f.budget.available(2.0) == pytest.approx(9.2)   # one retry: a -> b


def test_a_fallback_model_is_prepared_before_its_replica_is_picked() -> None:
    f, mesh = failover(), Mesh([rep("a"), rep("q1", INT8), rep("q2", INT8)])
    attempts = mesh.attempts(f)
    assert tried(attempts.next(0.0)) == ("a", FULL, "balance", 0)
    attempts.failed(engine_failed("a"), 0, 1.0)         # before any token: the chain is open to the request
    step = attempts.next(1.0)
    assert isinstance(step, Prepare)
    assert (step.plan.model, step.plan.degraded, step.plan.degraded_by, step.plan.confidence) == (
        INT8, True, "capacity", 0.8)
    assert [r.replica_id for r in step.plan.candidates] == ["q1", "q2"] and len(mesh.picks) == 1
    with pytest.raises(RuntimeError):
        attempts.next(1.1)                              # the new model's prompt first
    attempts.prepared(RouteRequest(INT8), 0)
    assert tried(attempts.next(1.2)) == ("q1", INT8, "fallback", 1)
    assert mesh.picks[-1] == (["q1", "q2"], INT8, 1.2) and attempts.plans == 2
    attempts.replied(1.4)
    attempts.failed(engine_failed("q1"), 2, 2.0)        # mid-stream on the fallback: stays on its model
    assert tried(attempts.next(2.0)) == ("q2", INT8, "fallback", 2)
    assert mesh.pools[-1] == (INT8, {"a", "q1"}) and mesh.picks[-1] == (["q2"], INT8, 2.0)


def test_a_resumed_stream_stays_on_its_model() -> None:
    mesh = Mesh([rep("a", healthy=False), rep("q1", INT8)])
    attempts = mesh.attempts(failover(), streamed=4)
    with pytest.raises(Saturated) as caught:
        attempts.next(0.0)
    assert caught.value.detail == f"{FULL}: 1 unhealthy; {INT8}: no replica"
    assert mesh.pools == [(FULL, set())]


def test_replanning_when_probes_vanish_stops_at_four_times_max_attempts() -> None:
    f = failover(max_attempts=2, replica=BreakerConfig(failure_threshold=1, open_s=5.0, probes=1))
    mesh = Mesh([rep("a")])
    opened = f.start(mesh.replicas[0], 0.0)
    assert opened is not None
    f.record(opened, 0.0, ok=False)                     # "a" half-open from 5
    stolen: list[Pass] = []

    def pool(streamed: str | None, failed: Collection[str]) -> list[Replica]:
        while stolen:                                   # the other request gives its probe back
            f.replica_breaker("a").release(stolen.pop())
        return mesh.pool(streamed, failed)

    def pick(candidates: Sequence[Replica], route: RouteRequest, now: float) -> Decision:
        granted = f.replica_breaker("a").acquire(now)    # another request takes the probe meanwhile
        assert granted is not None
        stolen.append(granted)
        return mesh.pick(candidates, route, now)

    attempts = Attempts(Call(f, FULL, 5.0), pool, pick, RouteRequest(FULL))
    assert attempts.next(5.0) == Fail(f"no replica could be started for {FULL!r}; retry shortly")
    assert attempts.plans == 8 and len(mesh.picks) == 8 and attempts.call.attempts == 0
    attempts.close(6.0)                                 # a call that never started gives its model pass back
    assert attempts.call.done and f.model_breaker(FULL).window.count(6.0) == 0


def test_a_cancelled_try_is_no_outcome_and_ends_the_call() -> None:
    f, mesh = failover(), Mesh([rep("a"), rep("b")])
    attempts = mesh.attempts(f)
    attempts.next(0.0)
    attempts.replied(0.3)
    attempts.cancelled(0.5)                             # the client left
    assert attempts.call.done
    assert f.replica_breaker("a").window.count(0.5) == 0 and f.model_breaker(FULL).window.count(0.5) == 0
    with pytest.raises(RuntimeError):
        attempts.next(0.6)
    attempts.close(0.7)
    assert f.states(0.7) == {"a": BreakerState.CLOSED}


def test_an_odd_ending_mid_try_gives_its_passes_back_on_close() -> None:
    f = failover(replica=BreakerConfig(failure_threshold=1, open_s=5.0, probes=1))
    mesh = Mesh([rep("a")])
    opened = f.start(mesh.replicas[0], 0.0)
    assert opened is not None
    f.record(opened, 0.0, ok=False)
    attempts = mesh.attempts(f, 5.0)
    assert tried(attempts.next(5.0)) == ("a", FULL, "balance", 0)
    assert f.refusal(mesh.replicas[0], 5.0) == "probing"
    with pytest.raises(RuntimeError):
        attempts.next(5.1)                              # one step at a time: the try's outcome first
    attempts.close(5.5)                                 # e.g. a bug raised mid-relay
    assert f.refusal(mesh.replicas[0], 5.5) == "" and attempts.call.done
