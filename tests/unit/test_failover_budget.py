"""RetryBudget (services/router/failover/budget.py): retries <= 20% of requests + a floor, per window."""

from __future__ import annotations

import pytest

from services.router.failover import RetryBudget


def spend_all(budget: RetryBudget, now: float) -> int:
    n = 0
    while budget.try_spend(now):
        n += 1
        assert n < 10_000
    return n


def test_with_no_traffic_the_floor_still_allows_retries() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=1.0, window_s=10.0)
    assert budget.available(0.0) == 10.0
    assert spend_all(budget, 0.0) == 10 and budget.refused == 1


def test_a_burst_of_failures_cannot_retry_more_than_the_budget() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=1.0, window_s=10.0)
    for _ in range(100):
        budget.note_request(0.0)
    # 100 requests all failing at once: 20% of them plus the floor of 10, and no more.
    assert spend_all(budget, 0.5) == 30
    assert not budget.try_spend(9.9) and budget.refused == 2


def test_the_budget_refills_with_time() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=1.0, window_s=10.0)
    for _ in range(100):
        budget.note_request(0.0)
    assert spend_all(budget, 0.0) == 30
    assert budget.available(9.999) == 0.0
    # At 10 the retries (and the requests) of 0 have left the window: the floor is back.
    assert budget.available(10.0) == 10.0 and spend_all(budget, 10.0) == 10


def test_the_budget_grows_with_the_request_rate() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=0.0, window_s=10.0)
    assert not budget.try_spend(0.0)
    for i in range(4):
        budget.note_request(1.0 + i)
    assert not budget.try_spend(5.0)            # 4 requests: 0.8 of a retry
    budget.note_request(5.0)
    assert budget.try_spend(5.0)                # 5 requests: one retry
    assert not budget.try_spend(5.0)
    for _ in range(5):
        budget.note_request(6.0)
    assert budget.try_spend(6.0) and not budget.try_spend(6.0)


def test_arguments_are_validated() -> None:
    with pytest.raises(ValueError):
        RetryBudget(ratio=-0.1)
    with pytest.raises(ValueError):
        RetryBudget(window_s=0.0)
