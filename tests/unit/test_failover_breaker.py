"""Breaker and OutcomeWindow (services/router/failover/breaker.py, window.py), on a fake clock."""

from __future__ import annotations

import pytest

from services.router.failover import Breaker, BreakerConfig, BreakerState, OutcomeWindow, p99

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def outcome(b: Breaker, now: float, ok: bool, latency_s: float | None = None) -> None:
    granted = b.acquire(now)
    assert granted is not None and not granted.probe
    b.record(granted, now, ok, latency_s)


def tripped(b: Breaker, now: float) -> None:
    """Open `b` at `now` with failures in a row."""
    for _ in range(b.config.failure_threshold):
        outcome(b, now, False)
    assert b.state(now) is OPEN


# -- window -----------------------------------------------------------------------------
def test_window_counts_what_happened_in_the_last_window_s() -> None:
    w = OutcomeWindow(10.0)
    w.add(0.0, False, None)
    w.add(5.0, True, 0.2)
    w.add(6.0, True, 0.1)
    assert (w.count(9.0), w.error_rate(9.0), w.latencies(9.0)) == (3, 1 / 3, [0.1, 0.2])
    assert (w.count(10.0), w.error_rate(10.0)) == (2, 0.0)       # the failure at 0 left at 10
    assert (w.count(16.0), w.error_rate(16.0), w.latencies(16.0)) == (0, 0.0, [])


def test_p99_is_nearest_rank() -> None:
    assert p99([1.0]) == 1.0
    assert p99([float(i) for i in range(1, 100)]) == 99.0       # under 100 samples: the largest
    assert p99([float(i) for i in range(1, 101)]) == 99.0       # 100: the 99th
    assert p99([float(i) for i in range(1, 1001)]) == 990.0


# -- closed -> open ---------------------------------------------------------------------
def test_opens_after_n_consecutive_failures_and_a_success_resets_the_count() -> None:
    b = Breaker(BreakerConfig(failure_threshold=3, min_samples=1000))
    outcome(b, 0.0, False)
    outcome(b, 0.1, False)
    outcome(b, 0.2, True)
    outcome(b, 0.3, False)
    outcome(b, 0.4, False)
    assert b.state(0.4) is CLOSED and b.reason == ""
    outcome(b, 0.5, False)
    assert b.state(0.5) is OPEN and b.reason == "3 consecutive failures" and b.opened == 1
    assert b.cause == "failures"
    assert b.half_open_at == 5.5 and not b.allows(0.5) and b.acquire(0.5) is None


def test_error_rate_opens_only_with_enough_samples() -> None:
    b = Breaker(BreakerConfig(failure_threshold=100, error_rate=0.05, min_samples=20, window_s=30.0))
    outcome(b, 0.0, False)
    outcome(b, 0.0, False)
    for i in range(17):
        outcome(b, 1.0 + i, True)
    assert b.window.count(17.0) == 19 and b.state(17.0) is CLOSED    # 2/19 = 10.5%, but only 19 samples
    outcome(b, 18.0, True)
    assert b.state(18.0) is OPEN
    assert b.reason == "error rate 10.0% > 5.0% over 20 requests in 30 s" and b.cause == "error_rate"


def test_error_rate_at_the_threshold_stays_closed_and_old_failures_expire() -> None:
    b = Breaker(BreakerConfig(failure_threshold=100, error_rate=0.05, min_samples=20, window_s=30.0))
    outcome(b, 0.0, False)
    for i in range(19):
        outcome(b, 1.0 + i, True)
    assert b.window.error_rate(19.0) == 0.05 and b.state(19.0) is CLOSED     # 1/20 is not above 5%
    outcome(b, 30.0, False)          # the failure at 0 has left the window: 1 failure in 20
    assert b.window.count(30.0) == 20 and b.state(30.0) is CLOSED
    outcome(b, 31.0, False)          # and the success at 1 left too: 2 failures in 20
    assert b.state(31.0) is OPEN and b.reason == "error rate 10.0% > 5.0% over 20 requests in 30 s"


def test_p99_over_target_opens_once_the_window_holds_enough_latencies() -> None:
    b = Breaker(BreakerConfig(p99_target_s=1.0, latency_min_samples=100, window_s=30.0))
    for _ in range(98):
        outcome(b, 0.0, True, 0.1)
    outcome(b, 0.0, False, 5.0)      # a failure's latency does not count
    outcome(b, 0.0, True, 2.0)
    assert b.state(0.0) is CLOSED    # 99 latencies: too few to judge
    outcome(b, 1.0, True, 0.1)
    assert b.state(1.0) is CLOSED    # 100 latencies, one slow: the P99 is 0.1
    outcome(b, 2.0, True, 2.0)
    assert b.state(2.0) is OPEN      # 101 latencies, two slow: the P99 is 2.0
    assert b.reason == "p99 latency 2.000 s > 1 s over 101 requests in 30 s" and b.cause == "latency"


def test_no_latency_breaker_without_a_target() -> None:
    b = Breaker(BreakerConfig(latency_min_samples=1))
    for _ in range(200):
        outcome(b, 0.0, True, 100.0)
    assert b.state(0.0) is CLOSED


# -- open -> half-open -> closed / open -------------------------------------------------
def test_half_open_after_the_open_period_then_probes_close_it() -> None:
    b = Breaker(BreakerConfig(failure_threshold=1, open_s=5.0, probes=2))
    tripped(b, 10.0)
    assert b.state(14.999) is OPEN and b.acquire(14.999) is None
    assert b.state(15.0) is HALF_OPEN
    first, second = b.acquire(15.0), b.acquire(15.0)
    assert first is not None and first.probe and second is not None and second.probe
    assert b.acquire(15.0) is None and not b.allows(99.0)      # two probes out: no third, however late
    b.record(first, 16.0, True)
    assert b.state(16.0) is HALF_OPEN and b.acquire(16.0) is None
    b.record(second, 17.0, True)
    assert b.state(17.0) is CLOSED and b.reason == b.cause == "" and b.half_open_at is None
    assert b.window.count(17.0) == 0


def test_a_probe_failure_reopens_with_backoff_up_to_the_cap() -> None:
    b = Breaker(BreakerConfig(failure_threshold=1, open_s=5.0, backoff=2.0, max_open_s=60.0, probes=1))
    tripped(b, 0.0)
    now, periods = 0.0, []
    for _ in range(6):
        assert b.half_open_at is not None
        now = b.half_open_at
        probe = b.acquire(now)
        assert probe is not None and probe.probe
        b.record(probe, now, False)
        assert b.state(now) is OPEN and b.reason == "a half-open probe failed" and b.cause == "probe"
        periods.append(b.half_open_at - now)
    assert periods == [10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    assert b.level == 4 and b.opened == 7


def test_backoff_starts_over_once_the_breaker_stayed_closed_a_whole_window() -> None:
    b = Breaker(BreakerConfig(failure_threshold=1, open_s=5.0, probes=1, window_s=30.0))
    tripped(b, 0.0)
    probe = b.acquire(5.0)
    assert probe is not None
    b.record(probe, 5.0, True)                   # closed at 5
    tripped(b, 20.0)                             # within a window of closing: a repeat
    assert b.level == 1 and b.half_open_at == 30.0
    probe = b.acquire(30.0)
    assert probe is not None
    b.record(probe, 30.0, True)                  # closed at 30
    tripped(b, 60.0)                             # a whole window later: starts over
    assert b.level == 0 and b.half_open_at == 65.0


def test_release_gives_a_probe_slot_back_without_an_outcome() -> None:
    b = Breaker(BreakerConfig(failure_threshold=1, probes=1))
    tripped(b, 0.0)
    probe = b.acquire(5.0)
    assert probe is not None and b.acquire(5.0) is None
    b.release(probe)
    assert b.state(5.0) is HALF_OPEN and b.acquire(5.0) is not None


def test_outcomes_from_before_an_open_or_close_are_ignored() -> None:
    b = Breaker(BreakerConfig(failure_threshold=2, probes=1))
    late = b.acquire(0.0)                        # a request started while closed ...
    assert late is not None
    tripped(b, 1.0)
    b.record(late, 2.0, True)                    # ... ends after the breaker opened: not a probe
    assert b.state(6.0) is HALF_OPEN
    probe, other = b.acquire(6.0), b.acquire(6.0)
    assert probe is not None and other is None
    b.record(probe, 6.0, True)
    assert b.state(6.0) is CLOSED
    stale = late._replace(probe=True)
    b.record(stale, 7.0, False)                  # nor does it count against the fresh closed state
    b.release(stale)
    assert b.state(7.0) is CLOSED and b.window.count(7.0) == 0 and not b.current(stale)


@pytest.mark.parametrize("kwargs", [
    {"failure_threshold": 0}, {"error_rate": 1.0}, {"p99_target_s": 0.0}, {"probes": 0},
    {"open_s": 10.0, "max_open_s": 5.0}, {"backoff": 0.5}, {"window_s": 0.0},
])
def test_config_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BreakerConfig(**kwargs)  # type: ignore[arg-type]
