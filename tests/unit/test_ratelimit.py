"""Token buckets and the in-flight bound, on a fake clock: no sleeps."""

import pytest

from mesh.ratelimit import InFlight, Limiter, Rate, TokenBucket, estimate_tokens, parse_rate, retry_after_s


@pytest.mark.parametrize("text,amount,period", [
    ("5/s", 5, 1), ("300/m", 300, 60), ("300/min", 300, 60), ("10000/h", 10000, 3600), (" 2.5 / s ", 2.5, 1),
    ("7", 7, 1),
])
def test_parse_rate(text: str, amount: float, period: float) -> None:
    assert parse_rate(text) == Rate(amount, period)


def test_parse_rate_default_unit_and_off() -> None:
    assert parse_rate("60000", default_unit="m") == Rate(60000, 60)
    assert parse_rate("") is None and parse_rate("0/s") is None
    for bad in ("five/s", "5/fortnight", "-1/s", "5/s/s"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    assert str(Rate(3, 1)) == "3/s" and str(Rate(300, 60)) == "300/m"


def test_bucket_allows_a_burst_then_the_rate() -> None:
    b = TokenBucket(per_s=3, capacity=3, now=100.0)
    assert [b.take(1, 100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(1, 100.0) == pytest.approx(1 / 3)          # empty: one token is 1/3 s away
    assert b.take(1, 100.2) == pytest.approx(1 / 3 - 0.2)
    assert b.take(1, 100.34) == 0.0                            # refilled just enough
    assert b.take(1, 100.34) > 0
    assert b.full(110.0) and b.level == 3                      # refill stops at the capacity


def test_refused_take_takes_nothing() -> None:
    b = TokenBucket(per_s=1, capacity=2, now=0.0)
    assert b.take(2, 0.0) == 0.0
    for _ in range(5):
        assert b.take(1, 0.5) == pytest.approx(0.5)
    assert b.take(1, 1.0) == 0.0


def test_oversized_request_waits_for_a_full_bucket_only() -> None:
    # A reservation above the capacity would never fit; it passes once the bucket is full.
    b = TokenBucket(per_s=10, capacity=100, now=0.0)
    assert b.take(30, 0.0) == 0.0
    assert b.wait_s(500, 0.0) == pytest.approx(3.0)
    assert b.take(500, 3.0) == 0.0 and b.level == -400       # the overrun is debt ...
    assert b.take(1, 3.0) == pytest.approx(40.1)              # ... paid back by refill first


def test_refund_and_settled_overrun() -> None:
    b = TokenBucket(per_s=1, capacity=100, now=0.0)
    assert b.take(60, 0.0) == 0.0
    b.give(60 - 20, 0.0)             # reserved 60, used 20: refund 40
    assert b.level == 80
    b.give(-50, 0.0)                 # used 50 more than reserved
    assert b.level == 30
    b.give(1000, 0.0)                # a refund never lifts it over the capacity
    assert b.level == 100


def test_limiter_keeps_one_bucket_per_caller() -> None:
    lim = Limiter(Rate(1, 1))
    assert lim.take("a", 1, 0.0) == 0.0 and lim.take("b", 1, 0.0) == 0.0
    assert lim.take("a", 1, 0.0) == pytest.approx(1.0)
    assert lim.take(b"digest", 1, 0.5) == 0.0
    assert lim.take("a", 1, 1.0) == 0.0


def test_limiter_forgets_least_recently_used_callers() -> None:
    lim = Limiter(Rate(1, 60), max_callers=3)
    for caller in ("a", "b", "c"):
        lim.take(caller, 1, 0.0)
    lim.take("a", 0, 1.0)            # "a" used again: "b" is now the oldest
    lim.take("d", 1, 2.0)
    assert len(lim) == 3
    assert lim.take("a", 1, 2.0) > 0             # still remembered, still empty
    assert lim.take("b", 1, 2.0) == 0.0          # forgotten: back with a full bucket


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert [retry_after_s(w) for w in (0.0, 0.01, 1.0, 1.0000001, 2.5)] == [1, 1, 1, 2, 3]


def test_in_flight_refuses_the_excess_at_once() -> None:
    gate = InFlight(2)
    assert gate.enter() and gate.enter() and not gate.enter()
    gate.leave()
    assert gate.enter() and gate.count == 2
    for _ in range(5):
        gate.leave()
    assert gate.count == 0


def test_estimate_tokens() -> None:
    assert estimate_tokens(40, 16) == 26
    assert estimate_tokens(1, 0) == 1 + 256
