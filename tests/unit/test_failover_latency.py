"""Level 3 by latency (services/router/failover/latency.py, levels.py, call.py): P95 time to first token
over target for a while -> a share of interactive requests to the fallback, until it recovers."""

from __future__ import annotations

import pytest

from services.router.failover import (
    Call,
    Failover,
    FailoverConfig,
    LatencyConfig,
    LatencyGuard,
    TtftWindow,
)
from services.router.replicas import Replica

FULL, INT8, TINY = "m", "m-int8", "tiny"
CHAIN = {FULL: (INT8, 0.8), INT8: (TINY, 0.5)}
SLOW = LatencyConfig(target_s=1.0, window_s=10.0, min_samples=20, after_s=5.0, share=0.3, recover=0.9)


def rep(rid: str, model: str = FULL) -> Replica:
    return Replica(rid, f"{rid}:1", model=model, healthy=True)


def fill(guard: LatencyGuard | Failover, at: float, ttft_s: float, n: int = 20, model: str = FULL) -> None:
    for _ in range(n):
        if isinstance(guard, Failover):
            guard.note_first_token(model, at, ttft_s)
        else:
            guard.record(model, at, ttft_s)


def failover(latency: LatencyConfig = SLOW, fallbacks: dict[str, tuple[str, float]] | None = None) -> Failover:
    return Failover(FailoverConfig(fallbacks=CHAIN if fallbacks is None else fallbacks, latency=latency))


def degrading_failover(share: float = 0.3) -> Failover:
    f = failover(LatencyConfig(target_s=1.0, window_s=60.0, min_samples=20, after_s=0.0, share=share))
    fill(f, 0.0, 2.0)
    assert f.latency.state(FULL, 0.0).degrading
    return f


# -- the window ---------------------------------------------------------------------------
def test_p95_is_nearest_rank_over_the_window_and_old_samples_leave() -> None:
    w = TtftWindow(10.0)
    for i in range(1, 21):
        w.add(float(i) / 10, float(i))         # 1 .. 20 s, added at 0.1 .. 2.0
    assert w.p95(2.0) == 19.0                  # ceil(0.95 * 20) = 19th of 20
    assert w.count(10.05) == 20
    assert w.count(10.55) == 15 and w.p95(10.55) == 20.0     # 1 .. 5 left (added at <= 0.5)
    assert w.p95(12.0) is None and w.count(12.0) == 0


# -- the state machine --------------------------------------------------------------------
def test_degrades_only_after_the_p95_stayed_over_target_for_after_s() -> None:
    g = LatencyGuard(SLOW)
    fill(g, 0.0, 2.0, n=19)
    assert g.state(FULL, 0.0).p95_s is None              # 19 samples: no verdict
    fill(g, 1.0, 2.0, n=1)
    assert g.state(FULL, 1.0) == (False, 2.0, 20, 1.0)   # over since the first look with 20
    assert not g.state(FULL, 5.9).degrading
    assert g.state(FULL, 6.0).degrading and g.episodes == 1
    assert "P95 time to first token 2.000 s over 1 s" in g.take_events()[0]


def test_a_look_under_target_restarts_the_wait() -> None:
    g = LatencyGuard(SLOW)
    fill(g, 0.0, 2.0)
    assert g.state(FULL, 0.0).over_since == 0.0
    fill(g, 3.0, 0.1, n=400)                  # the P95 falls under target at the look at 3.0
    assert g.state(FULL, 3.0).over_since is None
    fill(g, 3.5, 2.0, n=200)                  # and goes back over: the wait starts again
    assert not g.state(FULL, 8.0).degrading and g.state(FULL, 8.5).degrading


def test_hysteresis_it_leaves_only_at_recover_times_target() -> None:
    g = LatencyGuard(LatencyConfig(target_s=1.0, window_s=10.0, min_samples=20, after_s=0.0, recover=0.9))
    fill(g, 0.0, 2.0)
    assert g.state(FULL, 0.0).degrading
    fill(g, 5.0, 0.95)
    state = g.state(FULL, 10.5)               # the slow ones left: P95 0.95, under target, above 0.9
    assert (state.p95_s, state.degrading) == (0.95, True)
    fill(g, 12.0, 0.5)
    assert g.state(FULL, 15.5) == (False, 0.5, 20, None)
    assert "back within 0.9 x 1 s" in g.take_events()[-1]


def test_too_few_samples_is_no_evidence_and_ends_degradation() -> None:
    g = LatencyGuard(LatencyConfig(target_s=1.0, window_s=10.0, min_samples=20, after_s=0.0))
    fill(g, 0.0, 2.0)
    assert g.state(FULL, 0.0).degrading
    assert not g.state(FULL, 10.0).degrading        # every sample aged out


def test_the_share_is_exact_and_spread_out() -> None:
    f = degrading_failover(share=0.3)
    sent = [f.latency_fallback(FULL, 0.0) for _ in range(20)]
    assert [i + 1 for i, s in enumerate(sent) if s] == [4, 7, 10, 14, 17, 20]


def test_off_by_default_and_never_without_a_fallback() -> None:
    f = failover(LatencyConfig())
    fill(f, 0.0, 60.0, n=200)
    assert not f.latency.state(FULL, 100.0).degrading and not f.latency_fallback(FULL, 100.0)
    f = degrading_failover(share=1.0)
    fill(f, 0.0, 5.0, model="alone")          # a model with no chain degrades nowhere
    assert f.latency.state("alone", 0.0).degrading and not f.latency_fallback("alone", 0.0)


# -- the plan -----------------------------------------------------------------------------
def test_a_chosen_request_is_planned_on_the_fallback_marked_latency() -> None:
    f = degrading_failover()
    pool = [rep("a"), rep("q", INT8), rep("t", TINY)]
    plan = f.plan(FULL, pool, 0.0, prefer_fallback=True)
    assert (plan.model, plan.degraded, plan.degraded_by, plan.confidence, plan.confidence_source) == (
        INT8, True, "latency", 0.8, "configured")
    assert "P95 time to first token 2.000 s over the 1 s target" in plan.why
    plain = f.plan(FULL, pool, 0.0)
    assert (plain.model, plain.degraded, plain.degraded_by) == (FULL, False, "")


def test_latency_never_sheds_without_a_fallback_replica_the_model_serves() -> None:
    f = degrading_failover()
    plan = f.plan(FULL, [rep("a"), rep("t", TINY)], 0.0, prefer_fallback=True)
    assert (plan.model, plan.degraded, plan.why) == (FULL, False, "")
    # With neither, the chain goes on as for capacity: degraded to tiny.
    plan = f.plan(FULL, [rep("t", TINY)], 0.0, prefer_fallback=True)
    assert (plan.model, plan.degraded_by, plan.confidence) == (TINY, "capacity", pytest.approx(0.4))


# -- the call -----------------------------------------------------------------------------
def test_a_call_decides_once_and_a_retry_goes_back_to_the_model() -> None:
    f = degrading_failover(share=1.0)
    call = Call(f, FULL, 0.0)
    assert call.latency_fallback
    plan = call.plan([rep("a"), rep("q", INT8)], 0.0)
    assert plan.model == INT8
    attempt = call.start(plan.candidates[0], 0.0)
    assert attempt is not None and call.failed(attempt, 0.1)
    retry = call.plan([rep("a"), rep("q", INT8)], 0.1)      # q failed it: the model itself, not degraded
    assert (retry.model, retry.degraded) == (FULL, False)


def test_batch_requests_are_neither_degraded_nor_measured() -> None:
    f = degrading_failover(share=1.0)
    call = Call(f, FULL, 0.0, interactive=False)
    assert not call.latency_fallback
    assert call.plan([rep("a"), rep("q", INT8)], 0.0).model == FULL
    before = f.latency.state(FULL, 0.0).samples
    attempt = call.start(rep("a"), 0.0)
    assert attempt is not None
    call.succeeded(attempt, 1.0, latency_s=30.0)
    assert f.latency.state(FULL, 1.0).samples == before


def test_interactive_first_tokens_are_measured_per_model_even_from_a_failed_stream() -> None:
    f = failover()
    for i, model in enumerate((FULL, FULL, INT8)):
        call = Call(f, model, float(i))
        call.plan([rep("a"), rep("q", INT8)], float(i))
        attempt = call.start(rep("a") if model == FULL else rep("q", INT8), float(i))
        assert attempt is not None
        if i == 1:
            call.failed(attempt, float(i), latency_s=0.5)       # died after its first token
        else:
            call.succeeded(attempt, float(i), latency_s=0.25)
    assert f.latency.state(FULL, 3.0).samples == 2 and f.latency.state(INT8, 3.0).samples == 1


# -- configuration ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    ({"target_s": 0.0}, "--latency-degrade-p95-ms"),
    ({"target_s": -1.0}, "must be positive"),
    ({"window_s": 0.0}, "--latency-degrade-window"),
    ({"min_samples": 0}, "--latency-degrade-min-samples"),
    ({"after_s": -1.0}, "--latency-degrade-after"),
    ({"share": 0.0}, "--latency-degrade-share"),
    ({"share": 1.5}, r"fraction in \(0, 1\]"),
    ({"recover": 1.2}, "--latency-degrade-recover"),
])
def test_latency_config_is_validated_with_the_flag_named(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LatencyConfig(**kwargs)  # type: ignore[arg-type]


def test_latency_degradation_needs_a_fallback_chain() -> None:
    with pytest.raises(ValueError, match="needs a fallback chain"):
        FailoverConfig(latency=LatencyConfig(target_s=1.0))
