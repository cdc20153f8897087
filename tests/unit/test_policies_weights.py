"""Replica weights (services/router/policies/weighted.py) in every base policy and the affinity layers."""

from __future__ import annotations

from collections import Counter

import pytest

from services.router.policies import Balancing, LeastLoad, RoundRobin, make_policy
from services.router.policies.policy import Policy, RouteRequest
from services.router.policies.weighted import SmoothWeighted, load_per_weight, serving
from services.router.replicas import LoadReport, Replica

REQ = RouteRequest(model="m")


def rep(rid: str, weight: float = 1.0, in_flight: int = 0) -> Replica:
    r = Replica(rid, f"{rid}:1", model="m", healthy=True, in_flight=in_flight, weight=weight)
    r.apply_load(LoadReport(kv_blocks_total=100, kv_blocks_free=100, qps=5.0), now=0.0)
    return r


def sequential(policy: Policy, pool: list[Replica], n: int, request: RouteRequest = REQ) -> Counter[str]:
    """n requests one after another: each finishes before the next (every replica idle at each pick)."""
    picks: Counter[str] = Counter()
    for i in range(n):
        replica = policy.pick(pool, request, float(i)).replica
        policy.on_start(replica, request, float(i))
        policy.on_finish(replica, request, float(i), 0.1, True)
        picks[replica.replica_id] += 1
    return picks


def concurrent(policy: Policy, pool: list[Replica], n: int) -> Counter[str]:
    """n requests that all stay in flight: the load each pick adds is seen by the next."""
    picks: Counter[str] = Counter()
    for i in range(n):
        replica = policy.pick(pool, REQ, float(i)).replica
        replica.in_flight += 1
        picks[replica.replica_id] += 1
    return picks


# -- smooth weighted round-robin -------------------------------------------------------------
def test_smooth_weighted_round_robin_is_nginxs_sequence() -> None:
    a, b, c = rep("a", 5), rep("b", 1), rep("c", 1)
    turns = SmoothWeighted()
    assert [turns.pick([a, b, c]).replica_id for _ in range(7)] == list("aabacaa")   # nginx's documented order
    assert [turns.current(r) for r in "abc"] == [0.0, 0.0, 0.0]                     # back where it started


def test_equal_weights_are_plain_round_robin_in_candidate_order() -> None:
    turns = SmoothWeighted()
    pool = [rep("a"), rep("b"), rep("c")]
    assert [turns.pick(pool).replica_id for _ in range(6)] == list("abcabc")


def test_a_replica_left_out_of_a_pick_keeps_its_turn_and_the_currents_sum_to_zero() -> None:
    a, b, c = rep("a", 2), rep("b", 1), rep("c", 1)
    turns = SmoothWeighted()
    for pool in ([a, b, c], [a, b], [b, c], [a, c], [a, b, c], [c]):
        turns.pick(pool)
        assert sum(turns.current(r) for r in "abc") == pytest.approx(0.0)


# -- 400 picks: weight 3 gets three times the requests of weight 1 -------------------------------------
@pytest.mark.parametrize("policy", [RoundRobin(), LeastLoad(), Balancing()], ids=["round_robin", "least_load",
                                                                                   "balancing"])
def test_sequential_requests_split_by_weight(policy: Policy) -> None:
    picks = sequential(policy, [rep("a", 3), rep("b", 1)], 400)
    assert picks == {"a": 300, "b": 100}


@pytest.mark.parametrize("name", ["round_robin", "least_load", "balancing", "balancing+region+prefix+session",
                                  "least_load+prefix"])
def test_every_registered_policy_honours_weights(name: str) -> None:
    picks = sequential(make_policy(name), [rep("a", 1), rep("b", 2), rep("c", 1)], 400)
    assert abs(picks["b"] - 200) <= 4 and abs(picks["a"] - 100) <= 4 and abs(picks["c"] - 100) <= 4, picks


@pytest.mark.parametrize("policy", [LeastLoad(), Balancing()], ids=["least_load", "balancing"])
def test_load_is_divided_by_weight_under_concurrency(policy: Policy) -> None:
    pool = [rep("a", 3), rep("b", 1)]
    picks = concurrent(policy, pool, 400)
    assert abs(picks["a"] - 300) <= 3 and picks["a"] + picks["b"] == 400, picks
    assert load_per_weight(pool[0]) == pytest.approx(load_per_weight(pool[1]), abs=1.0)


def test_least_load_takes_the_lowest_load_per_weight() -> None:
    heavy, light = rep("heavy", 4, in_flight=6), rep("light", 1, in_flight=2)
    assert LeastLoad().pick([heavy, light], REQ, 0.0).replica is heavy      # 1.5 per weight against 2
    assert Balancing().pick([heavy, light], REQ, 0.0).replica is heavy


def test_fractional_weights() -> None:
    picks = sequential(RoundRobin(), [rep("a", 0.5), rep("b", 1.5)], 400)
    assert picks == {"a": 100, "b": 300}


# -- weight 0: a standby ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["round_robin", "least_load", "balancing", "balancing+region+prefix+session"])
def test_weight_zero_takes_nothing_while_another_is_a_candidate(name: str) -> None:
    standby, a = rep("standby", 0), rep("a", 1, in_flight=50)          # even a busy replica beats a standby
    policy = make_policy(name)
    assert sequential(policy, [standby, a], 20) == {"a": 20}
    # Nothing else admitted (failover hands the policy only the standbys): they share as if of weight 1.
    assert sequential(policy, [standby, rep("standby-2", 0)], 20) == {"standby": 10, "standby-2": 10}


def test_the_standby_rule() -> None:
    a, s = rep("a", 2), rep("s", 0)
    assert serving([a, s]) == [a] and serving([s]) == [s] and serving([a]) == [a]


def test_a_pinned_request_reaches_a_standby() -> None:
    policy = make_policy("balancing+prefix+session")
    decision = policy.pick([rep("a"), rep("standby", 0)], RouteRequest("m", pinned="standby"), 0.0)
    assert (decision.replica.replica_id, decision.reason) == ("standby", "pinned")


def test_affinity_does_not_send_a_session_to_a_standby() -> None:
    policy = make_policy("balancing+session")
    standby, a = rep("standby", 0), rep("a")
    for i in range(20):
        request = RouteRequest("m", session_key=f"s-{i}")
        assert policy.pick([standby, a], request, 0.0).replica is a


def test_affinity_judges_overload_per_unit_of_weight() -> None:
    policy = make_policy("least_load+session")
    big, small = rep("big", 4, in_flight=12), rep("small", 1, in_flight=3)
    big.running, small.running = 12, 3     # all running: nothing queued, only the imbalance can tell
    # 12 outstanding on weight 4 is 3 per weight, level with small: not overloaded, the session stays.
    assert not policy.overloaded(big, min(load_per_weight(r) for r in (big, small)))
    big.weight = 1.0                       # the same 12 on weight 1: 9 above small, past max_imbalance (4)
    assert policy.overloaded(big, min(load_per_weight(r) for r in (big, small)))
