"""Finding 7 of issue 49: batch lines bypassed the token budget.  A tenant at 1,000 tokens a minute was refused a
chat (429), then ran the same body as a batch line at once (1,866 tokens, twice): the lines reserved from a
bucket of their own.

Now a line reserves its tokens from the token bucket of the interactive caller that created the batch
(services/edge/batch/admission.py, Admission.enter_batch_line): a line over the budget waits for it (the
runner tries it again after its Retry-After; it is not failed), what a line uses is gone for that caller's
interactive requests, and a line larger than the whole budget fails with interactive's `request_too_large`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from mesh.apikeys import digest
from mesh.clients.router_client import Delta, ServedBy
from mesh.ratelimit import Limiter
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from tests.fakes.edge_router import FakeRouter, asgi
from tests.unit.test_batches import submit

KEY = {"authorization": "Bearer k-free"}
SERVED = ServedBy("engine-0", "m", "1", "local", False, 1.0)
# The probe's body: about 900 tokens reserved, and the "engine" says it used 7 + 900.
BODY = {"model": "m", "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 900}


def _free_tier(tmp_path: Path) -> tuple[EdgeApp, FakeRouter]:
    keys, tiers = tmp_path / "keys", tmp_path / "tiers.json"
    keys.write_text("k-free tenant=acme tier=free\n")
    tiers.write_text(json.dumps({"free": {"tokens": "1000/m"}}))
    router = FakeRouter([Delta("story", "stop", 7, 900, served_by=SERVED)])
    app = EdgeApp(EdgeConfig(keys_file=str(keys), tiers_file=str(tiers), response_cache_ttl_s=0), router)  # type: ignore[arg-type]
    return app, router


def _tokens(app: EdgeApp) -> Limiter:
    limit = app.admission._limiter(app.admission.directory.tiers["free"], "tokens")
    assert limit is not None
    return limit


async def _batch(app: EdgeApp, bodies: list[dict[str, Any]]) -> str:
    text = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": b}) + "\n" for i, b in enumerate(bodies))
    return await submit(app, text.encode(), KEY)


async def _record(app: EdgeApp, bid: str) -> dict[str, Any]:
    _, _, raw = await asgi(app, "GET", f"/v1/batches/{bid}", b"", KEY)
    return dict(json.loads(raw))


async def _ended(app: EdgeApp, bid: str, seconds: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while (record := await _record(app, bid))["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, record
        await asyncio.sleep(0.02)
    return record


def test_a_tenant_refused_a_chat_for_tokens_cannot_run_it_as_a_batch_line(tmp_path: Path) -> None:
    """The probe: one chat spends 907 of the 1,000; the same chat again is refused; the same body as a batch
    line does not run either: a second later it has not reached the router, and it is waiting (in progress,
    nothing failed), not failed."""
    async def main() -> None:
        app, router = _free_tier(tmp_path)
        body = json.dumps(BODY).encode()
        assert (await asgi(app, "POST", "/v1/chat/completions", body, KEY))[0] == 200
        status, _, raw = await asgi(app, "POST", "/v1/chat/completions", body, KEY)
        assert status == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
        level = _tokens(app).bucket(digest("k-free"), time.monotonic()).level
        bid = await _batch(app, [BODY])
        await asyncio.sleep(1.5)
        assert len(router.calls) == 1                                   # the line never reached the router
        record = await _record(app, bid)
        assert record["status"] == "in_progress", record
        assert record["request_counts"] == {"total": 1, "completed": 0, "failed": 0}
        now = _tokens(app).bucket(digest("k-free"), time.monotonic()).level
        assert level <= now < level + 60                                # refill only (16.7 a second): none taken
        assert (await asgi(app, "POST", f"/v1/batches/{bid}/cancel", b"", KEY))[0] == 200

    asyncio.run(main())


def test_what_a_batch_line_uses_is_gone_from_the_tenants_interactive_budget(tmp_path: Path) -> None:
    """The other way round: a line spends 907 tokens, then the tenant's chat asking for 900 more is refused."""
    async def main() -> None:
        app, router = _free_tier(tmp_path)
        record = await _ended(app, await _batch(app, [BODY]))
        assert record["status"] == "completed" and record["request_counts"]["completed"] == 1
        status, _, raw = await asgi(app, "POST", "/v1/chat/completions", json.dumps(BODY).encode(), KEY)
        assert status == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded", raw
        assert len(router.calls) == 1

    asyncio.run(main())


def test_a_line_larger_than_the_whole_budget_fails_as_interactive_does(tmp_path: Path) -> None:
    async def main() -> None:
        app, router = _free_tier(tmp_path)
        record = await _ended(app, await _batch(app, [{**BODY, "max_tokens": 5000}]))
        assert record["status"] == "completed" and record["request_counts"] == {"total": 1, "completed": 0,
                                                                               "failed": 1}
        _, _, raw = await asgi(app, "GET", f"/v1/files/{record['error_file_id']}/content", b"", KEY)
        line = json.loads(raw.decode().splitlines()[0])
        assert line["response"]["status_code"] == 429
        assert line["response"]["body"]["error"]["code"] == "request_too_large"
        assert router.calls == []

    asyncio.run(main())
