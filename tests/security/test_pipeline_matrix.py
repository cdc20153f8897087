"""Issue 49: every surface against every policy, in one matrix (in-process edge over the scripted router).

Surfaces: chat, completions, Responses (each whole and streamed), batch lines (chat and Responses lines, through
the edge's own routes as the batch runner runs them), embeddings, /tokenize.  Policies: input rules, output rules
on the channel that carries model text, the token budget, admission (places in flight), storage (what a stored
conversation keeps) and caching (what the response cache keeps).  A cell a policy does not apply to says why in
NOT_APPLICABLE, so the matrix is whole.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from services.edge.app import EdgeApp
from services.edge.batch.admission import budget_name
from services.edge.batch.lines import batch_caller
from tests.fakes.scripted_router import ScriptedRouter, app, events, request, tokens

KEY = "k-acme"
AUTH = {"authorization": f"Bearer {KEY}"}
SURFACES = ["chat", "chat-stream", "completions", "completions-stream", "responses", "responses-stream",
            "batch-chat", "batch-responses", "embeddings", "tokenize"]
POLICIES = ["input", "output", "budget", "admission", "storage", "caching"]
NOT_APPLICABLE = {
    **{(s, "output"): "no model text: an embedding's vector, a tokenizer's ids" for s in ("embeddings", "tokenize")},
    **{(s, "budget"): "no generation to budget: tokenizing costs no engine tokens" for s in ("tokenize",)},
    **{(s, "admission"): "batch lines hold batch places (tests/security/test_batches_share.py), not these"
       for s in ("batch-chat", "batch-responses")},
    ("tokenize", "admission"): "no engine call: the router's tokenizer answers",
    **{(s, "storage"): "stores no conversation" for s in ("completions", "completions-stream", "embeddings",
                                                          "tokenize", "batch-chat")},
    **{(s, "caching"): "never cached: only chat and completions answers are" for s in (
        "responses", "responses-stream", "batch-chat", "batch-responses", "embeddings", "tokenize")},
}
BLOCKED = ["The", " secret", " is", " in", " the", " bo", "mb", " shelter", "."] + [" more"] * 40


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "keys").write_text(f"{KEY} tenant=acme tier=tiny\n")
    (tmp_path / "tiers.json").write_text(json.dumps({"tiny": {"tokens": "300/m"}}))
    (tmp_path / "policy.json").write_text(json.dumps({"input": [{"category": "weapons", "pattern": "bomb"}],
                                                      "output": [{"category": "weapons", "pattern": "bomb"}],
                                                      "window": 8}))
    return {"keys_file": str(tmp_path / "keys"), "tiers_file": str(tmp_path / "tiers.json"),
            "content_policy": str(tmp_path / "policy.json")}


def _body(surface: str, text: str, **extra: Any) -> dict[str, Any]:
    kind = surface.removeprefix("batch-").removesuffix("-stream")
    stream = {"stream": True} if surface.endswith("-stream") else {}
    if kind == "chat":
        return {"model": "m", "messages": [{"role": "user", "content": text}], **stream, **extra}
    if kind == "completions":
        return {"model": "m", "prompt": text, **stream, **extra}
    if kind == "responses":
        return {"model": "m", "input": text, **stream, **{("max_output_tokens" if k == "max_tokens" else k): v
                                                          for k, v in extra.items()}}
    if kind == "embeddings":
        return {"model": "m", "input": text}
    return {"model": "m", "prompt": text}


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "embeddings": "/v1/embeddings", "tokenize": "/tokenize"}


async def call(edge: EdgeApp, surface: str, body: dict[str, Any], headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, Any]]:
    """(status, the answer: the whole JSON, or a stream's last event folded into the whole shape)."""
    kind = surface.removeprefix("batch-").removesuffix("-stream")
    if surface.startswith("batch-"):
        caller = edge.admission.directory.by_key(KEY)
        assert caller is not None
        line = batch_caller(edge.admission, {"tenant": caller.tenant, "tier": caller.tier.name,
                                             "label": caller.label, "budget": budget_name(caller)})
        status, answer, _ = await edge.batch_runner.call(line, PATHS[kind], body)
        return status, answer
    status, _, raw = await request(edge, "POST", PATHS[kind], body, {**AUTH, **(headers or {})})
    if not surface.endswith("-stream") or status != 200:
        return status, json.loads(raw)
    if kind == "responses":
        return status, _events(raw)[-1]["response"]
    chunks = events(raw)
    key = "delta" if kind == "chat" else None
    text = "".join((c["choices"][0][key].get("content") or "") if key else c["choices"][0].get("text", "")
                   for c in chunks if c.get("choices"))
    finish = next(c["choices"][0]["finish_reason"] for c in reversed(chunks) if c.get("choices"))
    return status, {"choices": [{"finish_reason": finish, "text": text, "message": {"content": text}}]}


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


def _text(kind: str, answer: dict[str, Any]) -> tuple[str, str]:
    """(the answer's text, how it ended)."""
    if kind == "responses":
        text = "".join(p["text"] for i in answer["output"] if i["type"] == "message" for p in i["content"])
        return text, (answer.get("incomplete_details") or {}).get("reason") or answer["status"]
    choice = answer["choices"][0]
    return (choice.get("text") if kind == "completions" else choice["message"]["content"]) or "", \
        choice["finish_reason"]


def _edge(router: ScriptedRouter, files: dict[str, str], **config: Any) -> EdgeApp:
    return app(router, **{"response_cache_ttl_s": 0, **files, **config})


async def input_rule(surface: str, files: dict[str, str]) -> None:
    router = ScriptedRouter(tokens(["fine"]))
    status, answer = await call(_edge(router, files), surface, _body(surface, "how to build a bomb"))
    assert (status, answer["error"]["code"]) == (400, "content_filter") and router.calls == []


async def output_rule(surface: str, files: dict[str, str]) -> None:
    router = ScriptedRouter(tokens(BLOCKED, finish="length"))
    status, answer = await call(_edge(router, files), surface, _body(surface, "where?", max_tokens=60))
    text, ended = _text(surface.removeprefix("batch-").removesuffix("-stream"), answer)
    assert status == 200 and ended == "content_filter" and "bo" not in text.replace("The", "")
    assert router.sent < 20                           # the call was stopped at the block


async def budget(surface: str, files: dict[str, str]) -> None:
    """A request larger than the tenant's whole budget (300 tokens a minute) never runs, on any surface."""
    router = ScriptedRouter(tokens(["fine"]))
    body = _body(surface, "x " * 2000, max_tokens=200)
    status, answer = await call(_edge(router, files), surface, body)
    assert (status, answer["error"]["code"]) == (429, "request_too_large") and router.calls == []


async def admission(surface: str, files: dict[str, str]) -> None:
    """A full edge (one place, held) refuses the next request of every surface with 503 before the router."""
    router = ScriptedRouter(tokens(["fine"]))
    edge = _edge(router, files, max_concurrent=1)
    edge.admission.in_flight.enter()
    status, answer = await call(edge, surface, _body(surface, "hi", max_tokens=4))
    assert (status, answer["error"]["code"]) == (503, "overloaded") and router.calls == []


async def storage(surface: str, files: dict[str, str]) -> None:
    """A stored conversation keeps what went out, never what the output rules hid."""
    router = ScriptedRouter(tokens(BLOCKED, finish="length"))
    headers = {"x-session-id": "s-1"} if surface.startswith("chat") else {}
    status, _ = await call(_edge(router, files), surface, _body(surface, "where?", max_tokens=60), headers)
    assert status == 200 and router.calls[0].caller_stores_turn
    (_, answer), = router.turns
    assert answer.content.startswith("The secret is in the") and "bo" not in answer.content.replace("The", "")


async def caching(surface: str, files: dict[str, str]) -> None:
    """An answer cut by the output rules is never cached: the same request reaches the router again."""
    router = ScriptedRouter(tokens(BLOCKED, finish="length"))
    edge = _edge(router, files, response_cache_ttl_s=60)
    body = _body(surface, "where?", max_tokens=60, temperature=0)
    for _ in range(2):
        status, _ = await call(edge, surface, body)
        assert status == 200
    assert len(router.calls) == 2
    clean = ScriptedRouter(tokens(["fine", "."]))
    edge = _edge(clean, files, response_cache_ttl_s=60)
    for _ in range(2):
        await call(edge, surface, body)
    assert len(clean.calls) == 1                      # a clean answer is (the cache works here)


CHECKS: dict[str, Callable[[str, dict[str, str]], Coroutine[Any, Any, None]]] = {
    "input": input_rule, "output": output_rule, "budget": budget, "admission": admission, "storage": storage,
    "caching": caching}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("surface", SURFACES)
def test_every_surface_passes_every_policy(files: dict[str, str], surface: str, policy: str) -> None:
    if (surface, policy) in NOT_APPLICABLE:
        pytest.skip(NOT_APPLICABLE[surface, policy])
    asyncio.run(CHECKS[policy](surface, files))
