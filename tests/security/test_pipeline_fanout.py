"""Issue 49, finding 5: one caller's fan-out saturated everyone.  A free-tier tenant looping 32 prompts x n 16
took one in-flight place for ~512 router calls, and another tenant's requests got 503 on 6-10 of 12; the
engine's waiting bound was shared by all tenants.  Now a request takes a place per router call it makes, a
request of more calls than half the edge never fits (429, no retry), and where callers are told apart (keys,
tokens) a tenant is refused (429) past its fair share while the edge is nearly full, so another tenant finds
room; the engine's waiting room keeps the same rule per tenant.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

from mesh.apikeys import digest
from mesh.ratelimit import InFlight, over_fair_share
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from services.engine.core.fairness import waiting_refusal
from tests.fakes.edge_router import FakeRouter, asgi

A = {"authorization": "Bearer k-a"}
B = {"authorization": "Bearer k-b"}


def _app(router: FakeRouter, **config: Any) -> EdgeApp:
    return EdgeApp(EdgeConfig(api_key_digests=(digest("k-a"), digest("k-b")), response_cache_ttl_s=0, **config),
                   router)  # type: ignore[arg-type]


async def _until(done: Callable[[], bool], seconds: float = 20.0) -> None:
    """Until `done()` holds (the requests in flight settled), polling; a bound for a stuck test, not a target."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "the requests did not settle"
        await asyncio.sleep(0.01)


def _completion(prompts: int, n: int) -> bytes:
    return json.dumps({"model": "m", "prompt": ["p"] * prompts, "n": n, "max_tokens": 4}).encode()


def test_fan_out_takes_a_place_per_call_and_another_tenant_is_still_served() -> None:
    async def main() -> None:
        router = FakeRouter()
        router.release = asyncio.Event()
        edge = _app(router, max_concurrent=64)
        status, _, raw = await asgi(edge, "POST", "/v1/completions", _completion(32, 16), A)      # 512 calls
        assert status == 429 and json.loads(raw)["error"]["code"] == "request_too_large"
        flood = [asyncio.create_task(asgi(edge, "POST", "/v1/completions", _completion(4, 4), A)) for _ in range(8)]
        await _until(lambda: sum(t.done() for t in flood) == 5 and edge.admission.in_flight.count == 48)
        # 16 calls a request: A fills 48 of the 64 places (three quarters), its next 5 requests are refused
        (tenant, held), = edge.admission.in_flight.held.items()
        assert held == 48 and edge.admission.in_flight.count == 48
        done = [t for t in flood if t.done()]
        assert len(done) == 5 and all(t.result()[0] == 429 for t in done)
        assert "its share" in json.loads(done[0].result()[2])["error"]["message"]
        others = [asyncio.create_task(asgi(edge, "POST", "/v1/completions", _completion(1, 1), B)) for _ in range(12)]
        await _until(lambda: edge.admission.in_flight.count == 60 or any(t.done() for t in others))
        assert not any(t.done() for t in others) and edge.admission.in_flight.count == 60    # all 12 admitted
        router.release.set()
        assert [status for status, _, _ in await asyncio.gather(*others)] == [200] * 12
        await asyncio.gather(*flood)
        assert edge.admission.in_flight.count == 0 and not edge.admission.in_flight.held
    asyncio.run(main())


def test_unauthenticated_loopback_callers_take_the_whole_edge() -> None:
    gate = InFlight(4)
    assert all(gate.enter() for _ in range(4)) and not gate.enter()


def test_the_fair_share_rule() -> None:
    assert not over_fair_share(Counter(), "a", 8)
    assert not over_fair_share(Counter({"a": 5}), "a", 8)           # 6 of 8: the quarter still free
    assert over_fair_share(Counter({"a": 6}), "a", 8)               # past 3/4 and over 8 // 2
    assert not over_fair_share(Counter({"a": 6}), "b", 8)           # another tenant finds room
    assert not over_fair_share(Counter({"a": 5, "b": 1}), "b", 8)   # b would hold 2 = 8 // (2 + 1)
    assert over_fair_share(Counter({"a": 5, "b": 2}), "b", 8)       # 3: over it
    assert not over_fair_share(Counter({"a": 1}), "a", 8, asking=4)


def test_the_engines_waiting_room_leaves_other_tenants_a_quarter() -> None:
    waiting: Counter[str] = Counter()
    while waiting_refusal(waiting, "flood", 256) is None:
        waiting["flood"] += 1
    assert waiting["flood"] == 192 and "its share" in str(waiting_refusal(waiting, "flood", 256))
    while waiting_refusal(waiting, "beta", 256) is None:
        waiting["beta"] += 1
    assert waiting["beta"] == 64 and "queue is full" in str(waiting_refusal(waiting, "beta", 256))
