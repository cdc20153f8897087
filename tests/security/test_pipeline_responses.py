"""Issue 49, finding 2: /v1/responses did not stop after a block, and stored what it hid.

Output rule `Paris`, a long essay asked for with max_output_tokens 200: 19 tokens released, the engine
generated all 200, status `incomplete` with reason `max_output_tokens`, and the next turn's input held the
whole unfiltered answer (the router stored the raw text).  Now a blocked response stops its call there, ends
`incomplete` with reason `content_filter`, and its turn is stored by the edge with only the released text
(the router is told not to store it: caller_stores_turn); tool calls are stored as calls.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.scripted_router import ScriptedRouter, app, request, tokens

ESSAY = ["The", " capital", " of", " France", " is", " Par", "is", ","] + [" and", " more"] * 96


@pytest.fixture
def policy(tmp_path: Path) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"output": [{"category": "places", "pattern": "Paris"}], "window": 8}))
    return str(path)


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_a_blocked_response_stops_ends_content_filter_and_stores_what_went_out(policy: str, stream: bool) -> None:
    async def main() -> None:
        router = ScriptedRouter(tokens(ESSAY, finish="length"))
        edge = app(router, content_policy=policy)
        status, _, raw = await request(edge, "POST", "/v1/responses", {
            "model": "m", "input": "Tell me about the capital of France, Paris, in a long essay.",
            "max_output_tokens": 200, "stream": stream})
        assert status == 200
        body = _events(raw)[-1]["response"] if stream else json.loads(raw)
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "content_filter"}
        text = "".join(p["text"] for item in body["output"] if item["type"] == "message" for p in item["content"])
        assert "Par" not in text and text.startswith("The capital of France is")
        # the call was stopped at the block: the scripted engine did not run on to its 200th token
        assert router.sent < 20
        # the router stores nothing itself; the edge stored the turn with the released text only
        assert router.calls[0].caller_stores_turn and router.calls[0].session_id == body["id"]
        (spec, answer), = router.turns
        assert spec.session_id == body["id"] and answer.role == "assistant" and answer.content == text
    asyncio.run(main())


def test_a_clean_response_is_stored_whole_and_not_stored_with_store_false(policy: str) -> None:
    async def main() -> None:
        router = ScriptedRouter(tokens(["Lyon", " is", " nice", "."]))
        edge = app(router, content_policy=policy)
        status, _, raw = await request(edge, "POST", "/v1/responses", {"model": "m", "input": "a city?"})
        body = json.loads(raw)
        assert status == 200 and body["status"] == "completed" and body["incomplete_details"] is None
        assert [a.content for _, a in router.turns] == ["Lyon is nice."]
        status, _, raw = await request(edge, "POST", "/v1/responses", {"model": "m", "input": "again", "store": False})
        assert status == 200 and len(router.turns) == 1 and not router.calls[-1].caller_stores_turn
    asyncio.run(main())


def test_a_length_cut_response_keeps_the_max_output_tokens_reason() -> None:
    async def main() -> None:
        router = ScriptedRouter(tokens(["a", " b"], finish="length"))
        status, _, raw = await request(app(router), "POST", "/v1/responses", {"model": "m", "input": "x",
                                                                             "max_output_tokens": 2})
        body = json.loads(raw)
        assert status == 200 and body["incomplete_details"] == {"reason": "max_output_tokens"}
    asyncio.run(main())


def test_tool_calls_are_stored_as_calls(policy: str) -> None:
    async def main() -> None:
        call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
        router = ScriptedRouter(tokens([call]))
        tool = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}}}}
        status, _, raw = await request(app(router), "POST", "/v1/responses", {"model": "m", "input": "weather?",
                                                                             "tools": [tool]})
        body = json.loads(raw)
        assert status == 200 and body["output"][0]["type"] == "function_call", body
        (_, answer), = router.turns
        calls = json.loads(answer.tool_calls)
        assert calls[0]["function"]["name"] == "weather" and "tool_call" not in answer.content
    asyncio.run(main())


@pytest.mark.parametrize(("headers", "extra"), [({"x-session-id": "resp_0123"}, {}), ({}, {"user": "resp_0123"})])
def test_a_chat_session_cannot_name_a_stored_response(headers: dict[str, str], extra: dict[str, Any]) -> None:
    """Finding 8: a chat `x-session-id` equal to a response id read and appended to that stored conversation."""
    async def main() -> None:
        router = ScriptedRouter(tokens(["ok"]))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
        status, _, raw = await request(app(router), "POST", "/v1/chat/completions", body, headers)
        assert status == 400 and "previous_response_id" in json.loads(raw)["error"]["message"]
        assert router.calls == []
        status, _, _ = await request(app(router), "POST", "/v1/chat/completions",
                                     {**body, "user": "alice"} if extra else body, {"x-session-id": "s-1"})
        assert status == 200 and router.calls[0].session_id == "s-1"
    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_sessions_turn_under_output_rules_is_stored_as_released(policy: str, stream: bool) -> None:
    """The same for chat sessions: under output rules the edge stores the turn (the router's copy would be raw)."""
    async def main() -> None:
        router = ScriptedRouter(tokens(ESSAY))
        body = {"model": "m", "messages": [{"role": "user", "content": "France?"}], "stream": stream}
        status, _, raw = await request(app(router, content_policy=policy), "POST", "/v1/chat/completions", body,
                                       {"x-session-id": "s-1"})
        assert status == 200 and router.calls[0].caller_stores_turn
        (spec, answer), = router.turns
        assert spec.session_id == "s-1" and answer.content == "The capital of France is " and router.sent < 20
        # without output rules the router stores the turn itself, as before
        plain = ScriptedRouter(tokens(["ok"]))
        await request(app(plain), "POST", "/v1/chat/completions", body, {"x-session-id": "s-1"})
        assert not plain.calls[0].caller_stores_turn and plain.turns == []
    asyncio.run(main())
