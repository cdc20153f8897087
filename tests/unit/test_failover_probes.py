"""ProbeVerdicts (services/router/failover/probes.py): isolate after misses in a row, re-admit at once."""

from __future__ import annotations

import pytest

from services.router.failover import ProbeVerdicts


def run(verdicts: ProbeVerdicts, answers: str, healthy: bool = False, rid: str = "a") -> str:
    """Feed probe answers ('+' answered, '-' missed); returns the health after each, as '+'/'-'."""
    out = []
    for answer in answers:
        healthy = verdicts.judge(rid, answer == "+", healthy)
        out.append("+" if healthy else "-")
    return "".join(out)


def test_a_healthy_replica_survives_single_misses_and_goes_after_two_in_a_row() -> None:
    assert run(ProbeVerdicts(2), "+-+-+--+") == "++++++-+"


def test_unhealthy_after_three() -> None:
    v = ProbeVerdicts(3)
    assert run(v, "+--+---") == "++++++-"
    assert v.misses("a") == 3


def test_a_replica_never_healthy_stays_out_until_it_answers() -> None:
    assert run(ProbeVerdicts(2), "--+") == "--+"


def test_one_miss_is_enough_with_unhealthy_after_one() -> None:
    assert run(ProbeVerdicts(1), "+-+") == "+-+"


def test_replicas_are_counted_apart_and_forgotten() -> None:
    v = ProbeVerdicts(2)
    assert run(v, "+-", rid="a") == "++"
    assert run(v, "+-", rid="b") == "++"
    assert run(v, "-", healthy=True, rid="a") == "-"      # a's second miss in a row
    v.forget("b")
    assert v.misses("b") == 0
    assert run(v, "-", healthy=True, rid="b") == "+"      # b starts afresh: its first miss


def test_unhealthy_after_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ProbeVerdicts(0)
