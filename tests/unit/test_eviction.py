"""Eviction policies: exact victim orders on a logical clock."""

from __future__ import annotations

import random

import pytest

from services.cache.eviction import LRU, LRU2, POLICIES, TenantPriority, make_policy


def test_lru_evicts_least_recently_used() -> None:
    p = LRU()
    for t, key in enumerate("abc", start=1):
        p.insert(key, t)
    p.touch("a", 4)
    assert p.peek() == "b"
    assert list(p.drain()) == ["b", "c", "a"]
    assert len(p) == 0 and p.pop() is None


def test_remove_takes_a_key_out_of_the_order() -> None:
    for name in POLICIES:
        p = make_policy(name)
        for t, key in enumerate("abc", start=1):
            p.insert(key, t)
        p.remove("a")
        p.remove("zzz")                     # unknown keys are ignored
        assert "a" not in p and len(p) == 2
        assert list(p.drain()) == ["b", "c"], name


def test_lru2_evicts_single_access_keys_first_then_oldest_second_access() -> None:
    p = LRU2()
    p.insert("a", 1)
    p.insert("b", 2)
    p.insert("c", 3)
    p.touch("a", 4)                         # a: accesses 1, 4
    p.touch("b", 5)                         # b: accesses 2, 5
    p.touch("a", 6)                         # a: 2nd most recent is now 4
    p.insert("d", 7)
    # c and d were accessed once (oldest last access first); then b (2nd access 2), a (4).
    assert list(p.drain()) == ["c", "d", "b", "a"]


def test_lru2_resists_a_scan_that_lru_does_not() -> None:
    """A prefix reused twice survives a burst of blocks put once; under LRU it goes first."""
    lru, lru2 = LRU(), LRU2()
    for p in (lru, lru2):
        p.insert("system-prompt", 1)
        p.touch("system-prompt", 2)
        for t in range(3, 10):
            p.insert(f"one-off-{t}", t)
    assert lru.pop() == "system-prompt"
    assert lru2.pop() == "one-off-3"
    assert list(lru2.drain())[-1] == "system-prompt"


def test_lru2_breaks_ties_by_call_order() -> None:
    p = LRU2()
    for key in "xyz":
        p.insert(key, 5)
    assert list(p.drain()) == ["x", "y", "z"]


def test_lru2_matches_a_brute_force_reference() -> None:
    rng = random.Random(7)
    p = LRU2()
    history: dict[int, list[int]] = {}
    for now in range(1, 3000):
        op = rng.random()
        if op < 0.45 or not history:
            key = rng.randrange(200)
            if key in history:
                p.touch(key, now)
                history[key].append(now)
            else:
                p.insert(key, now)
                history[key] = [now]
        elif op < 0.9:
            key = rng.choice(sorted(history))
            p.touch(key, now)
            history[key].append(now)
        else:
            def rank(k: int) -> tuple[int, int, int]:
                h = history[k]
                return (0, h[-1], h[-1]) if len(h) < 2 else (1, h[-2], h[-1])
            expected = min(history, key=rank)
            assert p.pop() == expected
            del history[expected]
    assert len(p) == len(history)


def test_tenant_priority_weights_and_ages() -> None:
    """GreedyDual: credit H = L + weight; the lowest H goes; L becomes the victim's H."""
    p = TenantPriority()                    # premium=4, standard=2, batch=1
    p.insert("prem", 1, "premium")          # H=4
    victims = []
    for t in range(2, 6):
        p.insert(f"batch-{t}", t, "batch")  # H = L + 1
        victims.append(p.pop())
    # Batch blocks go while L climbs 1, 2, 3; at L=3 the new batch block ties the premium
    # block's H=4 and the premium block, less recently used, goes.
    assert victims == ["batch-2", "batch-3", "batch-4", "prem"]
    assert p.inflation == 4
    assert list(p.drain()) == ["batch-5"]


def test_tenant_priority_touch_refreshes_credit_and_unknown_tenants_are_standard() -> None:
    p = TenantPriority()
    p.insert("std", 1, "standard")          # H=2
    p.insert("anon", 2, "")                 # unknown: the standard weight, H=2
    p.insert("batch", 3, "batch")           # H=1
    p.insert("prem", 4, "premium")          # H=4
    assert p.pop() == "batch"               # L=1
    p.touch("std", 5)                       # H = 1 + 2 = 3
    assert list(p.drain()) == ["anon", "std", "prem"]


def test_tenant_priority_remove_does_not_inflate() -> None:
    p = TenantPriority({"gold": 10, "tin": 1})
    p.insert("g", 1, "gold")
    p.remove("g")
    assert p.inflation == 0
    p.insert("t", 2, "tin")
    assert p.pop() == "t" and p.inflation == 1


def test_make_policy() -> None:
    assert isinstance(make_policy("lru"), LRU)
    assert isinstance(make_policy("lru2"), LRU2)
    tenant = make_policy("tenant", {"premium": 8, "batch": 1})
    assert isinstance(tenant, TenantPriority) and tenant.weight("premium") == 8 and tenant.weight("x") == 1
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="positive"):
        TenantPriority({"bad": 0})
