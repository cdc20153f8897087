"""services/edge/batch/admission.py: the batch places (caps per edge and per tenant, room interactive requests
leave, turns between tenants, waiting lines cancelled) and the token budget's saved name."""

from __future__ import annotations

import asyncio

import pytest

from mesh.apikeys import digest, tenant_of
from mesh.ratelimit import InFlight
from services.edge.batch import admission as batch_admission
from services.edge.batch.admission import BatchPlaces, budget_bucket, budget_name
from services.edge.config import EdgeConfig
from services.edge.gateway.tenants import STANDARD, AuthenticatedCaller, TenantTier


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_shares_of_the_interactive_limit() -> None:
    places = BatchPlaces.shared(InFlight(256), 0.25, 0.5)
    assert (places.edge_limit, places.tenant_limit) == (64, 32)
    places = BatchPlaces.shared(InFlight(3), 0.25, 0.5)
    assert (places.edge_limit, places.tenant_limit) == (1, 1)          # never none
    for bad in ({"batch_share": 0}, {"batch_share": 1.5}, {"batch_tenant_share": -0.1}):
        with pytest.raises(ValueError, match="at most 1"):
            EdgeConfig(**bad)  # type: ignore[arg-type]


def test_lines_wait_for_a_place_within_their_tenants_cap() -> None:
    async def main() -> None:
        places = BatchPlaces(InFlight(100), 3, 2)
        order: list[str] = []

        async def line(tenant: str) -> None:
            await places.acquire(tenant)
            order.append(tenant)

        for _ in range(2):
            await places.acquire("a")
        waiting = [asyncio.create_task(line(t)) for t in ("a", "a", "a", "b", "b")]
        await _settle()
        assert order == ["b"] and places.held == {"a": 2, "b": 1}      # a at its cap; b takes the last place
        places.release("b")
        await _settle()
        assert order == ["b", "b"] and places.held == {"a": 2, "b": 1}  # a's lines still wait: its cap
        places.release("b")
        await _settle()
        assert order == ["b", "b"] and places.total == 2                 # a place free, and a is at its cap
        for _ in range(3):
            places.release("a")
            await _settle()
        assert order == ["b", "b", "a", "a", "a"] and places.queued() == 0 and places.held == {"a": 2}
        await asyncio.gather(*waiting)

    asyncio.run(main())


def test_the_tenant_holding_fewer_places_goes_first() -> None:
    async def main() -> None:
        places = BatchPlaces(InFlight(100), 3, 3)
        order: list[str] = []

        async def line(tenant: str) -> None:
            await places.acquire(tenant)
            order.append(tenant)

        for _ in range(3):
            await places.acquire("a")
        waiting = [asyncio.create_task(line(t)) for t in ("a", "a", "b")]
        await _settle()
        assert order == [] and places.queued() == 3
        places.release("a")
        await _settle()
        assert order == ["b"]                        # a's lines asked first, but b held none
        places.release("a")
        places.release("b")
        await _settle()
        assert order == ["b", "a", "a"]
        await asyncio.gather(*waiting)

    asyncio.run(main())


def test_batch_lines_take_only_the_room_interactive_requests_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_admission, "POLL_S", 0.01)

    async def main() -> None:
        interactive = InFlight(4)
        places = BatchPlaces(interactive, 2, 2)
        await places.acquire("a")
        for _ in range(3):
            assert interactive.enter()
        line = asyncio.create_task(places.acquire("a"))
        await asyncio.sleep(0.05)
        assert not line.done() and places.total == 1                    # 3 interactive + 1 batch: the edge is full
        assert interactive.enter()                                      # interactive is never held back
        interactive.leave()
        interactive.leave()
        await asyncio.wait_for(line, 1)                                  # found by the poll, no release needed
        assert places.total == 2

    asyncio.run(main())


def test_a_line_cancelled_while_waiting_holds_no_place() -> None:
    async def main() -> None:
        places = BatchPlaces(InFlight(10), 1, 1)
        await places.acquire("a")
        line = asyncio.create_task(places.acquire("a"))
        await _settle()
        line.cancel()
        await asyncio.gather(line, return_exceptions=True)
        assert places.queued() == 0 and places.total == 1
        handed = asyncio.create_task(places.acquire("a"))
        await _settle()
        places.release("a")                          # the place is handed to the waiting line...
        handed.cancel()                              # ...which is cancelled before it runs: the place comes back
        await asyncio.gather(handed, return_exceptions=True)
        assert places.total == 0 and places.held == {}

    asyncio.run(main())


def test_a_budget_is_saved_by_a_name_that_is_not_the_key_and_found_again() -> None:
    tier = TenantTier(STANDARD)
    key = digest("secret-key")
    named = budget_name(AuthenticatedCaller(key, "t:acme", tier, "acme"))
    assert named == ["key", tenant_of(key)] and "secret" not in str(named) and key.hex() not in str(named)
    assert budget_bucket(named, "t:acme", [digest("other"), key]) == key
    assert budget_bucket(named, "t:acme", [digest("other")]) == ("batch-budget", "t:acme")    # the key is gone
    jwt = AuthenticatedCaller(("jwt", "acme", "alice"), "t:acme", tier, "acme")
    assert budget_bucket(budget_name(jwt), "t:acme", []) == ("jwt", "acme", "alice")
    anonymous = AuthenticatedCaller("127.0.0.1", "addr:127.0.0.1", tier, "anonymous")
    assert budget_bucket(budget_name(anonymous), "addr:127.0.0.1", []) == "127.0.0.1"
    assert budget_bucket(None, "t:acme", []) == ("batch-budget", "t:acme")          # a batch from before budgets
