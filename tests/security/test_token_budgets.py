"""Finding 3 of issue 31 (MEDIUM): the token limit reserved for one choice of one prompt.  A free tier
with `tokens: 1000/m` accepted three concurrent completions with 32 prompts, `n: 2`, `max_tokens: 32`
each: 6,786 tokens in 57 s; the 429 came only afterwards.

Now a request reserves every prompt's estimate plus prompts x n x max_tokens before it reaches the
router (services/edge/gateway/admission.py, mesh/ratelimit.py): one that can never fit the tier's budget is
refused at once (429 `request_too_large`, `x-should-retry: false`, no Retry-After), one that does not
fit now gets 429 with Retry-After, concurrent requests see each other's reservations, and usage across
all choices settles the reservation.  The router does the same for native gRPC callers, per API key,
with the exact prompt tokens once the prompt is tokenized (services/router/callers.py); the edge's own
calls are not charged twice.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from mesh import peers
from mesh.apikeys import digest, tenant_of
from mesh.errors import ResourceExhausted
from mesh.ratelimit import Limiter, Rate
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from services.router.callers import Caller, Callers
from tests.fakes.edge_router import FakeRouter, asgi
from tests.fakes.router_mesh import chat, run, running
from tests.security.edge_driver import Client, SlowRouter

KEY = {"authorization": "Bearer k-free"}
PROBE = {"model": "m", "prompt": [f"Write a haiku about the number {i}" for i in range(32)], "n": 2,
         "max_tokens": 32}


def _free_tier(tmp_path: Path, router: Any) -> EdgeApp:
    """An edge whose key `k-free` is in a tier allowing 1000 tokens a minute (and no response cache,
    so every request is answered afresh)."""
    keys, tiers = tmp_path / "keys", tmp_path / "tiers.json"
    keys.write_text("k-free tier=free\n")
    tiers.write_text(json.dumps({"free": {"tokens": "1000/m"}}))
    return EdgeApp(EdgeConfig(keys_file=str(keys), tiers_file=str(tiers), response_cache_ttl_s=0), router)


def _tokens(app: EdgeApp) -> Limiter:
    limit = app.admission._limiter(app.admission.directory.tiers["free"], "tokens")
    assert limit is not None
    return limit


def _level(app: EdgeApp) -> float:
    return _tokens(app).bucket(digest("k-free"), 0).level


def _body(raw: bytes) -> dict[str, Any]:
    return json.loads(raw)["error"]  # type: ignore[no-any-return]


def test_the_probe_is_refused_up_front_and_never_reaches_the_router(tmp_path: Path) -> None:
    """32 prompts x n 2 x max_tokens 32 = 2,048 completion tokens alone: more than the tier's whole
    minute, so no wait would let it pass.  All three concurrent copies are refused at once."""
    async def main() -> None:
        router = FakeRouter()
        app = _free_tier(tmp_path, router)
        body = json.dumps(PROBE).encode()
        answers = await asyncio.gather(*(asgi(app, "POST", "/v1/completions", body, KEY) for _ in range(3)))
        for status, headers, raw in answers:
            error = _body(raw)
            assert status == 429 and error["code"] == "request_too_large" and error["type"] == "tokens"
            assert headers["x-should-retry"] == "false" and "retry-after" not in headers
            message = error["message"]
            assert message.startswith("Request too large for tokens per min")
            assert "1000" in message and "free tier" in message and "2048" in message
            for lever in ("max_tokens", "n", "prompts"):
                assert lever in message
        assert router.calls == []
        assert _level(app) == pytest.approx(1000)            # nothing was taken for them

    asyncio.run(main())


def test_requests_that_fit_alone_but_not_together_are_refused_before_the_router(tmp_path: Path) -> None:
    """Each reserves 1 + 2 x 200 = 401 tokens: two fit in 1000, the third does not; it is told when to
    retry, and neither it nor its choices reach the router."""
    async def main() -> None:
        router = FakeRouter()
        router.release = asyncio.Event()            # the admitted ones stay in flight
        app = _free_tier(tmp_path, router)
        body = json.dumps({"model": "m", "prompt": "hi", "n": 2, "max_tokens": 200}).encode()
        tasks = [asyncio.create_task(asgi(app, "POST", "/v1/completions", body, KEY)) for _ in range(3)]
        done, _ = await asyncio.wait(tasks, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        [refused] = done
        status, headers, raw = refused.result()
        assert status == 429 and _body(raw)["code"] == "rate_limit_exceeded" and _body(raw)["type"] == "tokens"
        assert int(headers["retry-after"]) >= 1 and "x-should-retry" not in headers
        assert "401" in _body(raw)["message"]
        assert len(router.calls) == 2                # the two admitted requests' first choices; not the third's
        assert _level(app) == pytest.approx(1000 - 2 * 401, abs=1)
        router.release.set()
        assert sorted([(await t)[0] for t in tasks]) == [200, 200, 429]

    asyncio.run(main())


def test_usage_across_all_choices_settles_the_reservation(tmp_path: Path) -> None:
    """2 prompts x n 2 x max_tokens 100 reserve their 400 completion tokens while in flight; each choice
    answers 7 prompt + 2 completion tokens, so 2 x 7 + 4 x 2 = 22 are charged and the rest refunded."""
    async def main(stream: bool) -> None:
        router = FakeRouter()
        router.release = asyncio.Event()
        app = _free_tier(tmp_path, router)
        body = json.dumps({"model": "m", "prompt": ["abcd", "efgh"], "n": 2, "max_tokens": 100,
                           "stream": stream}).encode()
        task = asyncio.create_task(asgi(app, "POST", "/v1/completions", body, KEY))
        while not router.calls:
            await asyncio.sleep(0)
        assert _level(app) == pytest.approx(1000 - (2 + 400), abs=1)
        router.release.set()
        status, _, raw = await task
        assert status == 200 and len(router.calls) == 4
        if not stream:
            assert json.loads(raw)["usage"]["total_tokens"] == 22
        assert _level(app) == pytest.approx(1000 - 22, abs=1)

    asyncio.run(main(False))
    asyncio.run(main(True))


def test_a_stream_cut_mid_way_keeps_its_reservation(tmp_path: Path) -> None:
    """Its usage is unknown: what it reserved stays spent (the unused part is not refunded)."""
    async def main() -> None:
        router = SlowRouter(tokens=1000, every_s=0.01)
        app = _free_tier(tmp_path, router)        # type: ignore[arg-type]
        body = json.dumps({"model": "m", "prompt": "abcd", "max_tokens": 500, "stream": True}).encode()
        client = Client(app, "/v1/completions", body, KEY)
        task = asyncio.create_task(client.run())
        await router.started.wait()
        await asyncio.sleep(0.05)
        client.leave()
        await task
        assert router.cancelled == 1
        assert _level(app) == pytest.approx(1000 - 501, abs=1)

    asyncio.run(main())


# -- the router, for native gRPC callers ---------------------------------------------------------
NATIVE = digest("sk-native")


def test_callers_reserve_prompt_plus_max_tokens_and_settle_to_usage() -> None:
    callers = Callers((NATIVE,), token_limit=Rate(600, 60))          # 10 tokens a second
    me = Caller(tenant_of(NATIVE), NATIVE)
    first = callers.charge(me, max_tokens=300)
    assert first is not None
    callers.reserve(first, prompt_tokens=100, now=0.0)
    assert first.reserved == 400
    second = callers.charge(me, max_tokens=100)
    assert second is not None
    with pytest.raises(ResourceExhausted) as err:                    # 200 left, 250 asked: 5 s to wait
        callers.reserve(second, prompt_tokens=150, now=0.0)
    assert err.value.retry_after_s == 5 and "250" in err.value.message and second.reserved == 0
    callers.settle(second, now=0.0)                                  # refused: nothing to give back
    first.started, first.used = True, 130                            # settled to its usage: 270 back
    callers.settle(first, now=0.0)
    assert callers.tokens is not None and callers.tokens.bucket(NATIVE, 0.0).level == pytest.approx(470)
    callers.reserve(second, prompt_tokens=150, now=0.0)
    assert second.reserved == 250

    cut = callers.charge(me, max_tokens=10)                          # cut mid-stream: its usage is unknown
    assert cut is not None
    callers.reserve(cut, prompt_tokens=10, now=0.0)
    cut.started = True
    callers.settle(cut, now=0.0)
    assert callers.tokens.bucket(NATIVE, 0.0).level == pytest.approx(470 - 250 - 20)

    unbounded = callers.charge(me, max_tokens=0)                     # max_tokens 0: the default is reserved
    assert unbounded is not None
    callers.reserve(unbounded, prompt_tokens=1, now=60.0)
    assert unbounded.reserved == 1 + 256


def test_a_native_request_that_can_never_fit_is_refused_without_a_retry_time() -> None:
    callers = Callers((NATIVE,), token_limit=Rate(600, 60))
    charge = callers.charge(Caller(tenant_of(NATIVE), NATIVE), max_tokens=590)
    assert charge is not None
    with pytest.raises(ResourceExhausted) as err:
        callers.reserve(charge, prompt_tokens=20, now=0.0)
    assert err.value.retry_after_s == 0 and "610" in err.value.message and "600/m" in err.value.message
    assert "max_tokens" in err.value.message
    assert callers.tokens is not None and callers.tokens.bucket(NATIVE, 0.0).level == 600


def test_the_edge_and_keyless_callers_are_not_charged_at_the_router() -> None:
    callers = Callers((NATIVE,), token_limit=Rate(600, 60))
    assert callers.charge(Caller("t:acme"), max_tokens=10_000) is None      # the edge charged it already
    assert Callers(token_limit=Rate(600, 60)).charge(Caller("client"), 10) is None
    assert Callers((NATIVE,)).charge(Caller(tenant_of(NATIVE), NATIVE), 10) is None   # no token limit


def test_the_router_charges_a_native_key_with_its_exact_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process router (real dispatcher, fake tokenizer and engine): the prompt is 2 tokens, the
    engine reports 2 + max_tokens used.  Refusals never reach an engine; the edge is not charged."""
    kind = {"now": "client"}
    monkeypatch.setattr(peers, "kind", lambda context: kind["now"])
    key = (("authorization", "Bearer sk-native"),)

    async def scenario() -> None:
        async with running(engines=1, api_key_digests=(NATIVE,), token_limit=Rate(100, 60)) as mesh:
            async def generate(max_tokens: int) -> tuple[grpc.StatusCode, str, dict[str, str]]:
                try:
                    async for _ in mesh.router.Generate(chat(("user", "hi"), max_tokens=max_tokens), timeout=20,
                                                        metadata=key):
                        pass
                except grpc.aio.AioRpcError as err:
                    trailers = {k: str(v) for k, v in err.trailing_metadata() or ()}
                    return err.code(), err.details() or "", trailers
                return grpc.StatusCode.OK, "", {}

            budget = mesh.servicer.callers.tokens
            assert budget is not None
            assert (await generate(40))[0] == grpc.StatusCode.OK                 # 2 + 40 reserved and used
            assert budget.bucket(NATIVE, 0).level == pytest.approx(100 - 42, abs=1)
            code, details, trailers = await generate(200)                        # 202 > 100: never
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry-after" not in trailers
            assert "202" in details and "max_tokens" in details
            code, details, trailers = await generate(90)                         # 92 > about 58: not now
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and int(trailers["retry-after"]) >= 1
            assert len(mesh.script.calls) == 1
            kind["now"] = peers.TENANT_KIND                                      # the edge: not charged here
            assert (await generate(60))[0] == grpc.StatusCode.OK
            assert budget.bucket(NATIVE, 0).level < 100 - 42 + 5

    run(scenario)


def test_the_router_reads_the_edges_token_limit_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.router.__main__ import parse

    engine = ["--engine", "e0=127.0.0.1:1"]
    monkeypatch.delenv("INFERMESH_TOKEN_LIMIT", raising=False)
    assert parse(engine).token_limit is None
    monkeypatch.setenv("INFERMESH_TOKEN_LIMIT", "1000")                     # per minute, as at the edge
    assert parse(engine).token_limit == Rate(1000, 60)
    assert parse([*engine, "--token-limit", "50/s"]).token_limit == Rate(50, 1)
