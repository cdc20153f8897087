"""Affinity layers (pinned, region, prefix, session), the hash ring, the prefix map and the registry."""

from __future__ import annotations

import pytest

from services.router.policies import (
    POLICIES,
    AffinityRouter,
    NoReplica,
    PinnedReplicaUnavailable,
    PolicyConfig,
    RoundRobin,
    RouteRequest,
    make_policy,
)
from services.router.policies.hash_ring import HashRing
from services.router.policies.prefix_map import PrefixMap
from services.router.replicas import LoadReport, Replica


def rep(rid: str, region: str = "local", in_flight: int = 0, waiting: int = 0, free: int = 100) -> Replica:
    r = Replica(rid, f"{rid}:1", model="m", region=region, healthy=True, in_flight=in_flight)
    r.apply_load(LoadReport(waiting=waiting, kv_blocks_total=100, kv_blocks_free=free), now=0.0)
    return r


def hashes(*blocks: int) -> tuple[bytes, ...]:
    return tuple(b.to_bytes(4, "big") for b in blocks)


def route(policy: AffinityRouter, pool: list[Replica], req: RouteRequest, now: float = 0.0) -> tuple[str, str]:
    d = policy.pick(pool, req, now)
    policy.on_start(d.replica, req, now)
    return d.replica.replica_id, d.reason


def pick(policy: AffinityRouter, pool: list[Replica], req: RouteRequest) -> tuple[str, str]:
    """Decide without on_start: the prefix map learns nothing."""
    d = policy.pick(pool, req, 0.0)
    return d.replica.replica_id, d.reason




# -- registry ---------------------------------------------------------------------------
def test_registry_names_bases_and_layer_combinations() -> None:
    assert len(POLICIES) == 24
    for name in ("round_robin", "least_load", "balancing", "balancing+prefix", "balancing+prefix+session",
                 "round_robin+region+prefix+session"):
        assert name in POLICIES
    policy = POLICIES["balancing+prefix+session"]()
    assert policy.layers == {"prefix", "session"} and type(policy.base).__name__ == "Balancing"
    assert POLICIES["least_load+region"](PolicyConfig(region="eu")).config.region == "eu"


@pytest.mark.parametrize("name", ["random", "balancing+cache", "balancing+session+prefix", "balancing+prefix+prefix"])
def test_unknown_or_misordered_names_are_refused(name: str) -> None:
    assert name not in POLICIES
    with pytest.raises(ValueError):
        make_policy(name)


def test_empty_pool_raises_no_replica() -> None:
    with pytest.raises(NoReplica):
        POLICIES["balancing+prefix+session"]().pick([], RouteRequest("m", session_key="s"), 0.0)


# -- pinned -----------------------------------------------------------------------------
def test_pinned_wins_even_when_overloaded_and_absent_raises() -> None:
    pool = [rep("a"), rep("b", waiting=5)]          # b overloaded: queued 5 > max_queued 4
    policy = POLICIES["round_robin"]()
    assert route(policy, pool, RouteRequest("m", pinned="b")) == ("b", "pinned")
    with pytest.raises(PinnedReplicaUnavailable) as err:
        policy.pick(pool, RouteRequest("m", pinned="zz"), 0.0)
    assert err.value.replica_id == "zz"


# -- hash ring --------------------------------------------------------------------------
KEYS = [f"session-{i}" for i in range(10_000)]


def test_ring_is_stable_and_even() -> None:
    ring = HashRing([f"r{i}" for i in range(10)], vnodes=128)
    owners = [ring.owner(k) for k in KEYS]
    shuffled = HashRing([f"r{i}" for i in reversed(range(10))], 128)     # the order given does not matter
    assert owners == [shuffled.owner(k) for k in KEYS]
    counts = [owners.count(f"r{i}") for i in range(10)]
    assert min(counts) > 700 and max(counts) < 1300          # 1,000 each on average
    walk = list(ring.walk("x"))
    assert walk[0] == ring.owner("x") and sorted(walk) == [f"r{i}" for i in range(10)]   # each once


def test_adding_an_eleventh_replica_moves_at_most_2_of_11_sessions_all_to_it() -> None:
    before = HashRing([f"r{i}" for i in range(10)], 128)
    after = HashRing([f"r{i}" for i in range(11)], 128)
    moved = [k for k in KEYS if before.owner(k) != after.owner(k)]
    assert len(moved) <= 2 * len(KEYS) / 11
    assert {after.owner(k) for k in moved} == {"r10"}


def test_removing_a_replica_moves_only_its_sessions() -> None:
    before = HashRing([f"r{i}" for i in range(10)], 128)
    after = HashRing([f"r{i}" for i in range(10) if i != 3], 128)
    moved = {k for k in KEYS if before.owner(k) != after.owner(k)}
    assert moved == {k for k in KEYS if before.owner(k) == "r3"}


# -- session affinity -------------------------------------------------------------------
def test_session_goes_to_its_ring_owner_then_clockwise_past_overload() -> None:
    pool = [rep(f"r{i}") for i in range(4)]
    ring = HashRing([r.replica_id for r in pool], PolicyConfig().vnodes)
    order = list(ring.walk("alice"))
    policy = POLICIES["least_load+session"]()
    req = RouteRequest("m", session_key="alice")
    assert route(policy, pool, req) == (order[0], "session")
    by_id = {r.replica_id: r for r in pool}
    by_id[order[0]].waiting = 5
    assert route(policy, pool, req) == (order[1], "session")
    for r in pool:
        r.waiting = 5
    rid, reason = route(policy, pool, req)
    assert reason == "balance"                                     # everyone overloaded: the base decides
    assert route(policy, pool, RouteRequest("m"))[1] == "balance"  # no session key


def test_a_joining_replica_takes_only_sessions_from_others() -> None:
    pool = [rep(f"r{i}") for i in range(10)]
    policy = POLICIES["round_robin+session"]()
    before = {k: route(policy, pool, RouteRequest("m", session_key=k))[0] for k in KEYS[:2000]}
    pool.append(rep("r10"))
    kept = {k: route(policy, pool, RouteRequest("m", session_key=k))[0] for k in KEYS[:2000]}
    assert kept == before                       # a session with a replica stays on it
    policy.holders.clear()                      # sessions this router has not seen: the ring places them
    after = {k: route(policy, pool, RouteRequest("m", session_key=k))[0] for k in KEYS[:2000]}
    moved = [k for k in before if before[k] != after[k]]
    assert 0 < len(moved) <= 2 * 2000 / 11 and {after[k] for k in moved} == {"r10"}


# -- prefix affinity --------------------------------------------------------------------
def test_prefix_follows_where_it_was_sent_longest_first() -> None:
    a, b, c = rep("a"), rep("b"), rep("c")
    policy = POLICIES["round_robin+prefix"]()
    doc = hashes(*range(1, 9))
    assert route(policy, [a, b, c], RouteRequest("m", prefix_hashes=doc)) == ("a", "balance")   # unknown yet
    turn2 = doc + hashes(100, 101)
    assert route(policy, [a, b, c], RouteRequest("m", prefix_hashes=turn2)) == ("a", "prefix")
    policy.prefixes.record(turn2, "b")             # the longer prefix moved to b
    assert route(policy, [a, b, c], RouteRequest("m", prefix_hashes=turn2 + hashes(7))) == ("b", "prefix")


def test_overloaded_holder_falls_to_a_shorter_prefix_elsewhere_then_to_balance() -> None:
    a, b, c = rep("a"), rep("b"), rep("c")
    policy = POLICIES["least_load+prefix"]()
    doc = hashes(*range(1, 9))
    policy.prefixes.record(doc + hashes(50, 51), "b")   # a session's earlier turn
    policy.prefixes.record(doc, "a")                    # a later request for just the document
    req = RouteRequest("m", prefix_hashes=doc + hashes(50, 51, 52))
    assert pick(policy, [a, b, c], req) == ("b", "prefix")
    b.waiting = 5
    assert pick(policy, [a, b, c], req) == ("a", "prefix")       # b overloaded: a has the document
    a.waiting = 5
    assert pick(policy, [a, b, c], req) == ("c", "balance")      # every holder overloaded


def test_a_holder_far_above_the_least_loaded_is_overloaded_even_with_no_queue() -> None:
    # The engine admitted all ten into its batch: no queue, but each decodes several times slower.
    a, b = rep("a", in_flight=10), rep("b", in_flight=1)
    a.running = 10
    policy = POLICIES["least_load+prefix"](PolicyConfig(max_imbalance=4))
    policy.prefixes.record(hashes(*range(8)), "a")
    req = RouteRequest("m", prefix_hashes=hashes(*range(8)))
    assert a.queued == 0 and pick(policy, [a, b], req) == ("b", "balance")     # 10 - 1 > 4
    a.in_flight = a.running = 5
    assert pick(policy, [a, b], req) == ("a", "prefix")                         # 5 - 1 <= 4


def test_short_matches_and_departed_replicas_do_not_count() -> None:
    a, b = rep("a"), rep("b")
    policy = POLICIES["round_robin+prefix"](PolicyConfig(min_prefix_blocks=4))
    policy.prefixes.record(hashes(1, 2, 3), "b")                  # a shared chat-template header
    assert pick(policy, [a, b], RouteRequest("m", prefix_hashes=hashes(1, 2, 3, 9))) == ("a", "balance")
    policy.prefixes.record(hashes(1, 2, 3, 4, 5), "gone")
    assert pick(policy, [a, b], RouteRequest("m", prefix_hashes=hashes(1, 2, 3, 4, 5))) == ("b", "balance")
    policy.forget("gone")
    assert len(policy.prefixes) == 0


def test_prefix_map_is_a_bounded_lru() -> None:
    m = PrefixMap(capacity=3)
    m.record(hashes(1, 2), "a")
    m.record(hashes(3), "b")
    m.record(hashes(1), "c")                   # refreshes 1: 2 is now the oldest
    m.record(hashes(4), "d")
    assert len(m) == 3 and list(m.matches(hashes(1, 2))) == [("c", 1)]
    assert list(m.matches(hashes(1, 3, 4))) == [("d", 3), ("b", 2), ("c", 1)]


def test_prefix_comes_before_session() -> None:
    pool = [rep(f"r{i}") for i in range(4)]
    policy = POLICIES["balancing+prefix+session"]()
    owner = HashRing([r.replica_id for r in pool], PolicyConfig().vnodes).owner("s")
    other = next(r.replica_id for r in pool if r.replica_id != owner)
    doc = hashes(*range(10))
    policy.prefixes.record(doc, other)
    assert route(policy, pool, RouteRequest("m", session_key="s", prefix_hashes=doc)) == (other, "prefix")
    policy.holders.clear()                      # a session new to this router: its ring owner
    assert route(policy, pool, RouteRequest("m", session_key="s", prefix_hashes=hashes(77))) == (owner, "session")
    # A known holder that is overloaded: the ring owner has no better claim; balance decides.
    by_id = {r.replica_id: r for r in pool}
    by_id[other].waiting = 5
    for r in pool:
        r.in_flight = 0 if r.replica_id == owner else 1
    by_id[owner].kv_blocks_free = 10                             # the worst memory: balancing avoids it
    policy.holders.clear()                      # (a session with a replica would stay on it)
    rid, reason = pick(policy, pool, RouteRequest("m", session_key="s", prefix_hashes=doc))
    assert reason == "balance" and rid not in (owner, other)


def test_a_session_stays_on_its_replica_when_another_sessions_prefix_is_elsewhere() -> None:
    """Issue 20: three sessions send the same turns in turn; each session's turns stay on the replica its
    first turn went to, though an identical history of another session is cached elsewhere."""
    pool = [rep("a"), rep("b")]
    policy = POLICIES["balancing+prefix+session"]()
    # Each turn extends the conversation; the first is too short for prefix affinity (min_prefix_blocks),
    # so it is placed by the session's hash, and the later ones are prefixes another session cached.
    turns = [hashes(*range(2 * (t + 1))) for t in range(4)]
    placed: dict[str, set[str]] = {}
    for session in ("s1", "s2", "s3"):
        for t in turns:
            rid, _ = route(policy, pool, RouteRequest("m", session_key=session, prefix_hashes=t))
            placed.setdefault(session, set()).add(rid)
    assert all(len(r) == 1 for r in placed.values()), placed
    # Gone or overloaded: the session moves on, and stays where it moved.
    s1 = next(iter(placed["s1"]))
    rest = [r for r in pool if r.replica_id != s1]
    rid, _ = route(policy, rest, RouteRequest("m", session_key="s1", prefix_hashes=turns[0]))
    assert rid != s1
    assert route(policy, pool, RouteRequest("m", session_key="s1", prefix_hashes=hashes(99)))[0] == rid
    by_id = {r.replica_id: r for r in pool}
    by_id[rid].waiting = 9                                          # overloaded: it gives way
    assert route(policy, pool, RouteRequest("m", session_key="s1"))[0] != rid


# -- region affinity --------------------------------------------------------------------
def test_region_prefers_the_callers_region_then_spills() -> None:
    eu1, eu2, us1 = rep("eu1", "eu"), rep("eu2", "eu"), rep("us1", "us")
    policy = POLICIES["round_robin+region"](PolicyConfig(region="us"))
    assert route(policy, [eu1, eu2, us1], RouteRequest("m")) == ("us1", "region")          # router's own region
    got = [route(policy, [eu1, eu2, us1], RouteRequest("m", region="eu")) for _ in range(2)]
    assert sorted(got) == [("eu1", "region"), ("eu2", "region")]
    eu1.waiting = eu2.waiting = 5
    assert route(policy, [eu1, eu2, us1], RouteRequest("m", region="eu"))[1] == "spill"
    assert route(policy, [eu1, eu2], RouteRequest("m", region="ap"))[1] == "balance"      # no one there


def test_region_filters_before_prefix() -> None:
    eu, us = rep("eu", "eu"), rep("us", "us")
    policy = POLICIES["round_robin+region+prefix"](PolicyConfig(region="eu"))
    doc = hashes(*range(10))
    policy.prefixes.record(doc, "us")
    assert pick(policy, [eu, us], RouteRequest("m", prefix_hashes=doc)) == ("eu", "region")
    assert pick(policy, [eu, us], RouteRequest("m", prefix_hashes=doc, region="us")) == ("us", "prefix")


# -- the wrapper keeps the base's hooks and the entropy ----------------------------------
def test_wrapper_counts_entropy_and_forwards_hooks() -> None:
    base = RoundRobin()
    policy = AffinityRouter(base, ("prefix",))
    pool = [rep("a"), rep("b")]
    for i in range(4):
        route(policy, pool, RouteRequest("m"), float(i))
    assert policy.load_entropy(4.0) == pytest.approx(1.0)
    assert base.entropy.value(4.0, pool=2) == pytest.approx(1.0)
    policy.on_finish(pool[0], RouteRequest("m"), 5.0, 1.0, True)   # no state to keep: must not fail
