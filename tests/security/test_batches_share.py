"""Finding 3 of issue 49: one tenant's batches denied service to every other tenant.  Tenant A posted 40 batches
of 12 lines; each ran 8 lines at once through the edge's one in-flight pool (--max-concurrent 256, no cap per
tenant or per edge), so tenant B's next 8 interactive requests were all refused (503).

Now batch lines are a class of their own at the edge (services/edge/batch/admission.py): they take batch
places, never interactive ones; all tenants' lines together hold at most --batch-share of --max-concurrent
(1/4: 64 of 256), one tenant's at most --batch-tenant-share of those (1/2: 32), and a line with no place waits
for one instead of being refused.  Driven in-process over the router double, every request held in the
"engine" until released, so what is in flight can be counted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

from mesh.apikeys import digest
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from services.edge.metrics import BATCH_LINES
from tests.fakes.edge_router import CHAT_JSON, FakeRouter, asgi
from tests.unit.test_batches import lines, submit

A = {"authorization": "Bearer k-a"}
B = {"authorization": "Bearer k-b"}


def _app(router: FakeRouter, **config: Any) -> EdgeApp:
    return EdgeApp(EdgeConfig(api_key_digests=(digest("k-a"), digest("k-b")), response_cache_ttl_s=0, **config),
                   router)  # type: ignore[arg-type]


async def _batch(app: EdgeApp, who: dict[str, str], n: int) -> str:
    return await submit(app, lines(n), who)


async def _steady(router: FakeRouter, seconds: float = 0.3, at_least: int = 0) -> int:
    """The calls that reached the router once no more arrive for `seconds` (every one of them is held), after at
    least `at_least` have (a busy machine may pause the loop longer than `seconds` before they all come)."""
    deadline = time.monotonic() + 30
    while len(router.calls) < at_least and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    seen, since = -1, time.monotonic()
    while True:
        await asyncio.sleep(0.02)
        if len(router.calls) != seen:
            seen, since = len(router.calls), time.monotonic()
        elif time.monotonic() - since > seconds:
            return seen


async def _completed(app: EdgeApp, who: dict[str, str], bid: str, seconds: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        _, _, raw = await asgi(app, "GET", f"/v1/batches/{bid}", b"", who)
        record = dict(json.loads(raw))
        if record["status"] == "completed":
            return record
        assert time.monotonic() < deadline, record
        await asyncio.sleep(0.05)


def test_one_tenants_many_batches_leave_other_tenants_served() -> None:
    """The probe: A's 40 batches of 12 lines.  A's lines hold its 32 places (no more), B's batch still gets
    places of its own, B's 8 interactive requests are all admitted (none refused), and once the engine answers
    every batch completes without a line refused and tried again (they waited for their places)."""
    async def main() -> None:
        router = FakeRouter()
        router.release = asyncio.Event()
        app = _app(router)
        retried = BATCH_LINES.labels("retried")._value.get()
        a_batches = [await _batch(app, A, 12) for _ in range(40)]
        b_batch = await _batch(app, B, 12)
        await _steady(router)
        before = len(router.calls)
        chats = [asyncio.create_task(asgi(app, "POST", "/v1/chat/completions", CHAT_JSON, B)) for _ in range(8)]
        await _steady(router, at_least=before + 8)
        refused = [t.result()[0] for t in chats if t.done()]
        assert refused == [], f"B's interactive requests answered at once (refused): {refused}"
        interactive = [c for c in router.calls if c.priority == "interactive"]
        assert len(interactive) == 8                                               # all 8 reached the engine
        lines_of = Counter(c.tenant for c in router.calls if c.priority == "batch")
        places = app.admission.batch_places
        assert places.edge_limit == 64 and places.tenant_limit == 32
        assert sorted(lines_of.values()) == [8, 32]     # A's lines hold its 32 places, B's batch its 8 at once
        assert places.queued() == 40 * 8 - 32                                      # A's other lines wait
        router.release.set()
        answers = await asyncio.wait_for(asyncio.gather(*chats), 30)
        assert [status for status, _, _ in answers] == [200] * 8
        for who, bid in [(A, b) for b in a_batches] + [(B, b_batch)]:
            record = await _completed(app, who, bid)
            assert record["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
        assert len(router.calls) == 41 * 12 + 8
        assert BATCH_LINES.labels("retried")._value.get() == retried               # no line was refused for room
        assert places.total == 0 and places.queued() == 0 and app.admission.in_flight.count == 0

    asyncio.run(main())


def test_interactive_requests_are_admitted_beyond_what_batches_leave() -> None:
    """A small edge (--max-concurrent 8: 2 batch places): interactive requests get all 8 of theirs while the
    batch holds its 2; batch lines take a place only while interactive ones leave one free, so with the edge
    full of interactive work a waiting line waits on, and takes a place once the interactive requests end."""
    async def main() -> None:
        router = FakeRouter()
        router.release = asyncio.Event()
        app = _app(router, max_concurrent=8, batch_tenant_share=1.0)
        first = await _batch(app, A, 4)
        assert await _steady(router, at_least=2) == 2
        # (one tenant holds at most 6 of the 8 while the edge is nearly full: its fair share leaves others room)
        chats = [asyncio.create_task(asgi(app, "POST", "/v1/chat/completions", CHAT_JSON, who))
                 for who in [B] * 6 + [A] * 2]
        assert await _steady(router, at_least=10) == 10 and app.admission.in_flight.count == 8
        status, _, _ = await asgi(app, "POST", "/v1/chat/completions", CHAT_JSON, B)    # the 9th: the limit's 503
        assert status == 503
        router.release.set()
        assert [s for s, _, _ in await asyncio.gather(*chats)] == [200] * 8
        await _completed(app, A, first)
        router.release = asyncio.Event()                    # the engine holds everything again
        held = [asyncio.create_task(asgi(app, "POST", "/v1/chat/completions", CHAT_JSON, who))
                for who in [A] * 6 + [B] * 2]
        await _steady(router, at_least=len(router.calls) + 8)
        second = await _batch(app, B, 2)
        await _steady(router)
        assert app.admission.in_flight.count == 8 and app.admission.batch_places.total == 0   # no room: lines wait
        assert app.admission.batch_places.queued() == 2
        router.release.set()
        await asyncio.gather(*held)
        await _completed(app, B, second)                    # the lines took places once the chats ended

    asyncio.run(main())
