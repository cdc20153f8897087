"""Finding 5 of issue 31 (LOW): an answer cached for a pinned model version outlived the version.

A request pinned with `x-infermesh-model-version` was answered from the response cache after that
version was no longer served (a fresh pinned request got 404, the cached one 200).  Now a pinned
answer is replayed only while some replica still serves its version.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from services.edge.gateway import response_cache
from tests.fakes.scripted_router import ScriptedRouter, app, request, tokens

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
PINNED = {"x-infermesh-model-version": "2"}


def test_a_pinned_answer_is_not_replayed_once_its_version_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(response_cache, "VERSIONS_MAX_AGE_S", 0.05)    # the model list's age bound

    async def main() -> None:
        router = ScriptedRouter(tokens(["Hello", "!"], version="2"), versions=("1", "2"))
        edge = app(router)
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", BODY, PINNED)
        assert status == 200 and json.loads(raw)["infermesh"]["model_version"] == "2"
        status, head, _ = await request(edge, "POST", "/v1/chat/completions", BODY, PINNED)
        assert (status, head.get("x-infermesh-cache"), len(router.calls)) == (200, "hit", 1)

        router.versions = ("1",)                          # version 2 unloaded everywhere, then a while
        await asyncio.sleep(0.2)
        status, head, _ = await request(edge, "POST", "/v1/chat/completions", BODY, PINNED)
        assert head.get("x-infermesh-cache") != "hit" and len(router.calls) == 2   # the router decides (404)
    asyncio.run(main())
