"""Gateway policies through the edge's ASGI app (a fake router behind it): tiers, signing, JWT, content
rules, response cache."""

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import jwt

from mesh import signing
from mesh.clients.router_client import Delta, ModelCard, ServedBy
from services.edge.app import EdgeApp
from services.edge.config import EdgeConfig
from tests.fakes.edge_router import FakeRouter, asgi

SECRET = "hs256-secret-of-at-least-32-bytes!"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SERVED = ServedBy("engine-0", "m", "1", "local", False, 1.0)


class Router(FakeRouter):
    def __init__(self, deltas: list[Delta] | None = None):
        super().__init__(deltas)
        self.version = "1"

    async def models(self, timeout: float = 5.0) -> list[ModelCard]:
        return [ModelCard("m", self.version, 1, 2048)]


def _app(tmp_path: Path, router: FakeRouter, **config: Any) -> EdgeApp:
    keys, tiers = tmp_path / "keys", tmp_path / "tiers.json"
    keys.write_text("k-free tenant=acme tier=free\nk-prem tenant=globex tier=premium\n"
                    "k-sign tenant=initech signing_secret=s3cr3t\n")
    tiers.write_text(json.dumps({"free": {"requests": "2/m", "priority": "batch", "cache_class": "batch"},
                                 "premium": {"requests": "600/m", "cache_class": "premium"}}))
    return EdgeApp(EdgeConfig(keys_file=str(keys), tiers_file=str(tiers), jwt_secret=SECRET, **config),
                   router)  # type: ignore[arg-type]


def _post(app: EdgeApp, key: str, body: dict[str, Any] | None = None, **headers: str
          ) -> Any:
    return asgi(app, "POST", "/v1/chat/completions", json.dumps(body or CHAT).encode(),
                {"authorization": f"Bearer {key}", **headers})


def test_a_free_key_gets_429_where_a_premium_key_in_the_same_burst_does_not(tmp_path: Path) -> None:
    async def main() -> None:
        router = FakeRouter()
        app = _app(tmp_path, router)
        statuses: dict[str, list[int]] = {"k-free": [], "k-prem": []}
        for _ in range(5):
            for key in statuses:
                statuses[key].append((await _post(app, key))[0])
        assert statuses["k-free"] == [200, 200, 429, 429, 429] and statuses["k-prem"] == [200] * 5
        free = [c for c in router.calls if c.tenant == "t:acme"]
        prem = [c for c in router.calls if c.tenant == "t:globex"]
        assert {(c.priority, c.cache_class) for c in free} == {("batch", "batch")}
        assert {(c.priority, c.cache_class) for c in prem} == {("interactive", "premium")}

    asyncio.run(main())


def test_signed_keys_must_sign_and_replays_are_refused(tmp_path: Path) -> None:
    async def main() -> None:
        app = _app(tmp_path, FakeRouter())
        body = json.dumps(CHAT).encode()
        status, _, answer = await _post(app, "k-sign")
        assert status == 401 and json.loads(answer)["error"]["code"] == "invalid_signature"
        signed = signing.sign_headers("s3cr3t", "POST", "/v1/chat/completions", body)
        auth = {"authorization": "Bearer k-sign"}
        assert (await asgi(app, "POST", "/v1/chat/completions", body, {**auth, **signed}))[0] == 200
        status, _, answer = await asgi(app, "POST", "/v1/chat/completions", body, {**auth, **signed})
        assert status == 401 and "already used" in json.loads(answer)["error"]["message"]
        stale = signing.sign_headers("s3cr3t", "POST", "/v1/chat/completions", body, now=time.time() - 600)
        status, _, answer = await asgi(app, "POST", "/v1/chat/completions", body, {**auth, **stale})
        assert status == 401 and "old" in json.loads(answer)["error"]["message"]
        # GET routes are signed over an empty body.
        get = signing.sign_headers("s3cr3t", "GET", "/v1/models")
        status, _, _ = await asgi(app, "GET", "/v1/models", b"", auth)
        assert status == 401
        app.router.models = Router().models   # type: ignore[method-assign]
        assert (await asgi(app, "GET", "/v1/models", b"", {**auth, **get}))[0] == 200

    asyncio.run(main())


def test_jwt_tenant_is_honoured_and_an_expired_token_refused(tmp_path: Path) -> None:
    async def main() -> None:
        router = FakeRouter()
        app = _app(tmp_path, router)
        now = int(time.time())
        token = jwt.encode({"tenant": "umbrella", "tier": "premium", "exp": now + 60}, SECRET, algorithm="HS256")
        assert (await _post(app, token))[0] == 200
        assert router.calls[-1].tenant == "t:umbrella" and router.calls[-1].cache_class == "premium"
        expired = jwt.encode({"tenant": "umbrella", "exp": now - 60}, SECRET, algorithm="HS256")
        status, _, answer = await _post(app, expired)
        assert status == 401 and "expired" in json.loads(answer)["error"]["message"]
        unknown_tier = jwt.encode({"tenant": "umbrella", "tier": "gold", "exp": now + 60}, SECRET, algorithm="HS256")
        assert (await _post(app, unknown_tier))[0] == 401
        assert len(router.calls) == 1

    asyncio.run(main())


def test_content_rules_refuse_input_and_cut_output_split_across_tokens(tmp_path: Path) -> None:
    async def main() -> None:
        policy = tmp_path / "policy.json"
        policy.write_text(json.dumps({"input": [{"category": "weapons", "pattern": "build a bomb"}],
                                      "output": [{"category": "secrets", "pattern": "swordfish"}]}))
        router = FakeRouter([Delta("The code is ", ids=(1, 2, 3)), Delta("sword", ids=(4,)), Delta("fish", ids=(5,)),
                             Delta(" and more", ids=(6, 7)), Delta("", "stop", 9, 7, served_by=SERVED)])
        app = _app(tmp_path, router, content_policy=str(policy))
        bad = {**CHAT, "messages": [{"role": "user", "content": "How to BUILD a bomb"}]}
        status, _, answer = await _post(app, "k-prem", bad)
        assert status == 400 and json.loads(answer)["error"]["code"] == "content_filter" and router.calls == []
        status, _, answer = await _post(app, "k-prem", {**CHAT, "stream": True})
        assert status == 200 and b"sword" not in answer and b"fish" not in answer
        events = [json.loads(line[6:]) for line in answer.decode().split("\n\n") if line.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
        assert text == "The code is "
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "content_filter"
        status, _, answer = await _post(app, "k-prem")
        choice = json.loads(answer)["choices"][0]
        assert choice["finish_reason"] == "content_filter" and choice["message"]["content"] == "The code is "

    asyncio.run(main())


def test_deterministic_answers_come_from_the_cache_per_tenant(tmp_path: Path) -> None:
    async def main() -> None:
        router = Router([Delta("Hi", ids=(1,)), Delta("!", "stop", 7, 2, served_by=SERVED, ids=(2,))])
        app = _app(tmp_path, router)
        body = {**CHAT, "temperature": 0}
        first = await _post(app, "k-prem", body)
        second = await _post(app, "k-prem", body)
        assert len(router.calls) == 1 and second[1]["x-infermesh-cache"] == "hit"
        answer = json.loads(second[2])
        assert answer["infermesh"]["cached"] is True and answer["id"] != json.loads(first[2])["id"]
        assert answer["choices"] == json.loads(first[2])["choices"]
        streamed = await _post(app, "k-prem", {**body, "stream": True})
        assert len(router.calls) == 1 and b'"cached": true' in streamed[2] and streamed[2].endswith(b"[DONE]\n\n")
        await _post(app, "k-free", body)           # another tenant: not served from it
        assert len(router.calls) == 2
        await _post(app, "k-prem", body, **{"cache-control": "no-cache"})
        assert len(router.calls) == 3
        router.version = "2"                                               # a new default version
        app.completions.cache.versions.invalidate()
        await _post(app, "k-prem", body)
        assert len(router.calls) == 4
        await _post(app, "k-prem", {**body, "temperature": 0.8})          # not deterministic: never cached
        await _post(app, "k-prem", {**body, "temperature": 0.8})
        assert len(router.calls) == 6

    asyncio.run(main())


def test_a_streamed_answer_cached_keeps_its_logprob_offsets() -> None:
    """body() after a stream (what the cache stores) counts offsets from the prompt again."""
    from mesh.clients.router_client import TokenLogprob
    from services.edge.surfaces import choices, requests
    spec = requests.parse_completion({"model": "m", "prompt": "The sky is", "max_tokens": 2, "logprobs": 1,
                                    "temperature": 0})
    choice = choices.Choice(0, False, spec, "The sky is")
    for d in [Delta(" blue", logprobs=(TokenLogprob(1, " blue", -0.1),)),
              Delta(".", "stop", 4, 2, logprobs=(TokenLogprob(2, ".", -0.2),), served_by=SERVED)]:
        choice.add(d)
        choice.stream_logprobs(d)
    assert choice.body()["logprobs"]["text_offset"] == [10, 15]
