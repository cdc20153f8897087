"""Base balancing policies (round_robin, least_load, balancing), load entropy and replica load state."""

from __future__ import annotations

import math

import pytest

from mesh.discovery import Endpoint
from services.router.policies import Balancing, LeastLoad, LoadEntropy, NoReplica, PolicyConfig, RoundRobin
from services.router.policies.policy import RouteRequest
from services.router.replicas import LoadReport, Replica, ReplicaTable, TenantShare

REQ = RouteRequest(model="m")


def rep(rid: str, in_flight: int = 0, waiting: int = 0, free: int = 100, total: int = 100, p99: float = 0.0,
        running: int = 0, qps: float = 5.0) -> Replica:
    """qps 5.0 over the engines' 10 s window: a P99 of 50 requests, enough to be trusted."""
    r = Replica(rid, f"{rid}:1", model="m", healthy=True, in_flight=in_flight)
    r.apply_load(LoadReport(running=running, waiting=waiting, kv_blocks_total=total, kv_blocks_free=free,
                            p99_latency_ms=p99, qps=qps), now=0.0)
    return r


def ids(policy: RoundRobin | LeastLoad | Balancing, pool: list[Replica], n: int) -> list[str]:
    return [policy.pick(pool, REQ, float(i)).replica.replica_id for i in range(n)]


# -- replica state ----------------------------------------------------------------------
def test_apply_load_copies_the_report_and_stamps_the_time() -> None:
    r = Replica("a", "a:1")
    assert r.mem_ratio == 0.0 and r.load_at is None and r.load == LoadReport()
    r.in_flight = 7
    report = LoadReport(running=3, waiting=2, kv_blocks_total=200, kv_blocks_free=50, qps=1.5,
                        p50_latency_ms=10, p99_latency_ms=90, tokens_per_second=300, unix_ms=123)
    r.apply_load(report, now=4.0)
    assert (r.running, r.waiting, r.qps, r.p99_latency_ms, r.unix_ms, r.load_at) == (3, 2, 1.5, 90, 123, 4.0)
    assert r.load == report            # what ListReplicas reports back
    assert r.mem_ratio == 0.75
    assert r.outstanding == 9          # in_flight + waiting
    assert r.queued == 4               # in_flight - running beats the stale waiting=2


def test_table_follows_discovery_adds_moves_and_removes() -> None:
    table = ReplicaTable()
    added, removed = table.sync([Endpoint("engine", "a", "a:1"), Endpoint("engine", "b", "b:1", region="eu")])
    assert [r.replica_id for r in added] == ["a", "b"] and removed == []
    a, b = table.get("a"), table.get("b")
    assert a is not None and not a.healthy and b is not None and b.region == "eu"
    assert table.sync([Endpoint("engine", "a", "a:1"), Endpoint("engine", "b", "b:1", region="eu")]) == ([], [])
    # b moved address: a fresh replica; c is new; a left.
    added, removed = table.sync([Endpoint("engine", "b", "b:2"), Endpoint("engine", "c", "c:1")])
    assert sorted(r.replica_id for r in added) == ["b", "c"]
    assert sorted((r.replica_id, r.address) for r in removed) == [("a", "a:1"), ("b", "b:1")]
    assert [(r.replica_id, r.address) for r in table.all()] == [("b", "b:2"), ("c", "c:1")]
    assert table.get("a") is None and table.models() == []


# -- empty pools ------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [RoundRobin(), LeastLoad(), Balancing()])
def test_an_empty_pool_raises_no_replica(policy: RoundRobin) -> None:
    with pytest.raises(NoReplica):
        policy.pick([], REQ, 0.0)
    assert issubclass(NoReplica, ValueError)


# -- round robin ------------------------------------------------------------------------
def test_round_robin_cycles_in_candidate_order_and_survives_a_join() -> None:
    a, b, c = rep("a"), rep("b"), rep("c")
    rr = RoundRobin()
    assert ids(rr, [a, b], 4) == ["a", "b", "a", "b"]
    # Smooth weighted round-robin (weights 1): c joins level with a and b, whose turns are even after
    # four picks, so each of the three takes one of the next three; b leaving leaves a and c alternating.
    assert ids(rr, [a, b, c], 3) == ["a", "b", "c"]
    assert ids(rr, [a, c], 4) == ["a", "c", "a", "c"]
    assert rr.pick([a, b], REQ, 0.0).reason == "balance"


# -- least load -------------------------------------------------------------------------
def test_least_load_takes_fewest_in_flight_plus_waiting() -> None:
    pool = [rep("a", in_flight=4), rep("b", in_flight=1, waiting=3), rep("c", in_flight=2, waiting=1)]
    assert LeastLoad().pick(pool, REQ, 0.0).replica.replica_id == "c"   # 4, 4 vs 3


def test_least_load_takes_turns_among_ties_in_candidate_order() -> None:
    pool = [rep("a", in_flight=1), rep("b"), rep("c", in_flight=1), rep("d")]
    assert ids(LeastLoad(), pool, 4) == ["b", "d", "b", "d"]
    # A new least replica wins outright and does not advance the tie turn.
    ll = LeastLoad()
    assert ids(ll, [rep("a"), rep("b")], 1) == ["a"]
    assert ids(ll, [rep("a", in_flight=1), rep("b")], 1) == ["b"]
    assert ids(ll, [rep("a"), rep("b")], 1) == ["b"]


# -- balancing --------------------------------------------------------------------------
def test_balancing_score_formula_on_a_crafted_state() -> None:
    a = rep("a", in_flight=4, free=80)     # load ratio 1, mem 0.2
    b = rep("b", in_flight=2, free=20)     # load ratio 0.5, mem 0.8
    c = rep("c", in_flight=0, free=50)     # load ratio 0, mem 0.5
    scores = Balancing().scores([a, b, c], 0.0)
    assert scores == pytest.approx([0.4 * 0.8, 0.6 * 0.5 + 0.4 * 0.2, 0.6 + 0.4 * 0.5])
    assert Balancing().pick([a, b, c], REQ, 0.0).replica is c


def test_balancing_counts_the_askers_own_requests_twice_and_steers_it_off_its_heavy_replica() -> None:
    a = rep("a", in_flight=4, running=4)
    a.apply_load(LoadReport(running=4, kv_blocks_total=100, kv_blocks_free=100, qps=5.0,
                            tenants=(TenantShare("flood", 4, 0, 800),)), now=0.0)
    b = rep("b", in_flight=3, running=3)
    b.tenant_in_flight["calm"] = 3
    assert Balancing().scores([a, b], 0.0, "flood") == pytest.approx([0.4, 0.6 * (1 - 3 / 8) + 0.4])
    assert Balancing().pick([a, b], RouteRequest("m", tenant="flood"), 0.0).replica is b   # a has its 4
    assert Balancing().pick([a, b], RouteRequest("m", tenant="calm"), 0.0).replica is a    # b has its 3
    assert Balancing().pick([a, b], RouteRequest("m", tenant="new"), 0.0).replica is b     # 3 < 4: as before


def test_balancing_uses_waiting_not_qps_for_the_load_ratio() -> None:
    stalled = rep("stalled", waiting=6)
    stalled.qps = 0.0                      # finishes nothing: a qps ratio would call it idle
    busy = rep("busy", in_flight=2)
    busy.qps = 5.0
    assert Balancing().pick([stalled, busy], REQ, 0.0).replica is busy


def test_memory_weight_shifts_above_85_percent_mean() -> None:
    bal = Balancing()
    at = [rep("a", free=15), rep("b", free=15)]            # mean mem 0.85: not above
    above = [rep("a", free=14), rep("b", free=15)]         # mean 0.855
    assert bal.weights(at) == (0.6, 0.4)
    assert bal.weights(above) == (0.3, 0.7)
    # Under pressure the replica with free memory beats the one with the short queue.
    short_queue = rep("q", in_flight=3, free=2)            # mem 0.98
    free_memory = rep("m", in_flight=4, free=30)           # mem 0.70 -> pool mean 0.84: no shift yet
    assert bal.pick([short_queue, free_memory], REQ, 0.0).replica is short_queue
    free_memory.kv_blocks_free = 20                        # mem 0.80 -> mean 0.89: shift
    assert bal.pick([short_queue, free_memory], REQ, 0.0).replica is free_memory


def test_p99_weight_is_target_over_p99_capped_at_1_with_floor_01() -> None:
    bal = Balancing()
    assert bal.p99_weight(rep("a", p99=0), 0.0) == 1.0        # unknown
    assert bal.p99_weight(rep("a", p99=500), 0.0) == 1.0      # faster than target: capped
    assert bal.p99_weight(rep("a", p99=4000), 0.0) == 0.25
    assert bal.p99_weight(rep("a", p99=10_000), 0.0) == 0.1
    assert bal.p99_weight(rep("a", p99=60_000), 0.0) == 0.1   # floor, not 1/60
    slow, fast = rep("slow", p99=4000), rep("fast", in_flight=3, p99=800)
    assert bal.pick([slow, fast], REQ, 0.0).replica is fast   # 0.25 * 1.0 < 1.0 * 0.4


def test_a_p99_over_too_few_requests_is_not_trusted() -> None:
    bal = Balancing(PolicyConfig(p99_min_samples=20, engine_window_s=10.0))
    assert bal.p99_weight(rep("a", p99=4000, qps=2.0), 0.0) == 0.25     # 20 requests behind it
    assert bal.p99_weight(rep("a", p99=4000, qps=1.9), 0.0) == 1.0      # 19: the slowest of a few
    assert bal.p99_weight(rep("a", p99=4000, qps=0.0), 0.0) == 1.0


def test_p99_falls_back_to_the_routers_own_window() -> None:
    bal = Balancing(PolicyConfig(p99_min_samples=5))
    a = rep("a", qps=0.0)                                             # the engine reports no P99
    for i in range(10):
        bal.on_finish(a, REQ, now=float(i), latency_s=0.5 + 0.25 * i, ok=True)
    assert bal.p99_weight(a, 10.0) == pytest.approx(1000 / 2750)       # 2.75 s is the top sample, in window
    assert bal.p99_weight(a, 15.5) == 1.0                             # 4 samples left: too few
    assert bal.p99_weight(a, 10.0 + 10.5) == 1.0                      # all aged out


def test_balancing_all_overloaded_still_picks_the_best_and_ties_take_turns() -> None:
    pool = [rep(r, in_flight=50, waiting=40, free=1) for r in "abc"]
    assert ids(Balancing(), pool, 4) == ["a", "b", "c", "a"]
    pool[1].kv_blocks_free = 3
    assert Balancing().pick(pool, REQ, 0.0).replica.replica_id == "b"


def test_replica_joining_and_leaving() -> None:
    a, b = rep("a", in_flight=2), rep("b", in_flight=2)
    bal = Balancing()
    assert bal.pick([a, b, rep("new")], REQ, 0.0).replica.replica_id == "new"   # empty replica wins
    assert bal.pick([a], REQ, 0.0).replica is a


# -- entropy ----------------------------------------------------------------------------
def test_entropy_uniform_is_one_all_on_one_is_zero() -> None:
    e = LoadEntropy(window_s=60)
    for i in range(8):
        e.record(f"r{i % 4}", now=float(i))
    assert e.value(8.0, pool=4) == pytest.approx(1.0)
    e2 = LoadEntropy(window_s=60)
    for i in range(5):
        e2.record("r0", now=float(i))
    assert e2.value(5.0, pool=4) == 0.0


def test_entropy_counts_idle_replicas_and_forgets_old_picks() -> None:
    e = LoadEntropy(window_s=10)
    e.record("a", 0.0)
    e.record("b", 0.0)
    assert e.value(1.0, pool=4) == pytest.approx(math.log(2) / math.log(4))   # half the pool idle: 0.5
    e.record("a", 5.0)
    assert e.value(10.0, pool=2) == 0.0        # the two at t=0 left the window; only "a" remains
    assert e.value(100.0, pool=2) == 1.0       # nothing in the window: nothing unbalanced
    assert e.value(0.0, pool=1) == 1.0


def test_policy_load_entropy_tracks_started_requests() -> None:
    rr = RoundRobin(PolicyConfig(entropy_window_s=30))
    pool = [rep("a"), rep("b")]
    for i in range(4):
        d = rr.pick(pool, REQ, float(i))
        rr.on_start(d.replica, REQ, float(i))
    assert rr.load_entropy(4.0) == pytest.approx(1.0)
    for i in range(4, 10):
        rr.on_start(pool[0], REQ, float(i))
    assert rr.load_entropy(10.0) == pytest.approx(-(0.8 * math.log(0.8) + 0.2 * math.log(0.2)) / math.log(2))
