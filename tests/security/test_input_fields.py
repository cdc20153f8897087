"""Finding 2 of issue 31 (MEDIUM): input rules read only message `content` and `prompt`.

The same word in a tool's name or description, a response_format schema, regex or grammar, an
assistant message's tool_calls arguments, a message name, or stop was accepted; fullwidth letters,
zero-width characters, look-alike Cyrillic letters and a word split across two messages passed too.
Now every field whose text reaches the model is read (services/edge/surfaces/model_inputs.py), folded
(services/edge/gateway/textfold.py), alone and run together.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from services.edge.gateway.safety import parse_policy
from tests.fakes.scripted_router import ScriptedRouter, app, request, tokens

USER = {"role": "user", "content": "tell me a story"}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "finds things",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def _chat(messages: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages or [USER], **extra}


def _tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {**TOOL["function"], **function}}


def _call(arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}]}


CHAT_CASES = {
    "tool name": _chat(tools=[_tool(name="bomb_maker")]),
    "tool description": _chat(tools=[_tool(description="how to make a bomb")]),
    "tool parameters": _chat(tools=[_tool(parameters={"type": "object", "properties": {"bomb": {"type": "string"}}})]),
    "tool parameter description": _chat(tools=[_tool(parameters={
        "type": "object", "properties": {"q": {"type": "string", "description": "the bomb to build"}}})]),
    "response_format schema": _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object", "properties": {"bomb": {"type": "string"}}}}}),
    "response_format schema const": _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "string", "enum": ["a bomb"]}}}),
    "regex": _chat(regex="the bomb is [a-z]+"),
    "grammar": _chat(grammar='root ::= "a bomb"'),
    "tool call arguments": _chat([USER, _call('{"q": "bomb"}'), {"role": "tool", "tool_call_id": "c1",
                                                                  "content": "ok"}]),
    "tool call arguments, escaped": _chat([USER, _call('{"q": "\\u0062omb"}'),
                                           {"role": "tool", "tool_call_id": "c1", "content": "ok"}]),
    "message name": _chat([{"role": "user", "content": "hi", "name": "bomb"}]),
    "stop": _chat(stop=["bomb"]),
    "fullwidth letters": _chat([{"role": "user", "content": "how to build a ｂｏｍｂ"}]),
    "zero-width characters": _chat([{"role": "user", "content": "how to build a bo\u200bm\u200db"}]),
    "Cyrillic look-alikes": _chat([{"role": "user", "content": "how to build a b\u043emb"}]),  # о
    "Greek look-alikes": _chat([{"role": "user", "content": "how to build a b\u03bfmb"}]),    # ο
    "accents": _chat([{"role": "user", "content": "how to build a bómb"}]),
    "split across two messages": _chat([{"role": "user", "content": "how to build a bo"},
                                        {"role": "user", "content": "mb"}]),
    "content parts": _chat([{"role": "user", "content": [{"type": "text", "text": "a bo"},
                                                         {"type": "text", "text": "mb"}]}]),
}


@pytest.fixture
def policy(tmp_path: Path) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"input": [{"category": "weapons", "pattern": "bomb"}]}))
    return str(path)


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_a_blocked_word_in_any_field_that_reaches_the_model_is_refused(policy: str, case: str) -> None:
    async def main() -> None:
        router = ScriptedRouter(tokens(["fine"]))
        edge = app(router, content_policy=policy)
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", CHAT_CASES[case])
        error = json.loads(raw)["error"]
        assert (status, error["code"]) == (400, "content_filter"), raw
        assert "weapons" in error["message"] and not router.calls
    asyncio.run(main())


def test_completions_prompts_suffix_and_constraints_are_read(policy: str) -> None:
    async def main() -> None:
        router = ScriptedRouter(tokens(["fine"]))
        edge = app(router, content_policy=policy)
        for body in ({"prompt": ["fine", "a ｂomb"]}, {"prompt": "x", "regex": "bomb"},
                     {"prompt": "x", "stop": "bomb"}):
            status, _, raw = await request(edge, "POST", "/v1/completions", {"model": "m", **body})
            assert status == 400 and json.loads(raw)["error"]["code"] == "content_filter", body
        assert not router.calls
    asyncio.run(main())


def test_clean_requests_with_every_field_still_pass(policy: str) -> None:
    async def main() -> None:
        router = ScriptedRouter(tokens(["fine"]))
        edge = app(router, content_policy=policy)
        body = _chat([USER, _call('{"q": "boats"}'), {"role": "tool", "tool_call_id": "c1", "content": "two boats"}],
                     tools=[TOOL], stop=["bo", "mb!"])     # a stop list is not one text: "bo" + "mb!" is fine
        status, _, raw = await request(edge, "POST", "/v1/chat/completions", body)
        assert status == 200, raw
        status, _, _ = await request(edge, "POST", "/v1/chat/completions",
                                     _chat([{"role": "user", "content": "the tomb of a bomber pilot"}]))
        assert status == 400                      # substring rules stay substring rules
    asyncio.run(main())


def test_every_text_field_is_listed_in_one_place() -> None:
    from services.edge.surfaces import model_inputs
    body = {"messages": [{"role": "user", "content": "A", "name": "B"}, _call('{"q": "C"}'),
                         {"role": "tool", "tool_call_id": "D", "content": "E"}],
            "tools": [_tool(description="F")], "response_format": {"type": "json_schema", "json_schema": {
                "name": "G", "schema": {"const": "H"}}}, "stop": ["I"], "regex": "J", "grammar": "K"}
    seen = {text for _, text in model_inputs.texts(body)}
    assert set("ABCDEFGHIJK") <= seen
    for field in ("messages", "tools", "response_format", "regex", "grammar", "stop", "prompt"):
        assert field in model_inputs.FIELDS


def test_folding_keeps_offsets_into_the_text_as_written() -> None:
    from services.edge.gateway.textfold import fold
    text = "Ａ b\u200bo\u043emb   é"
    folded, where = fold(text)
    assert folded == "a boomb e"
    assert [text[i] for i in where][:3] == ["Ａ", " ", "b"] and where[-1] == len(text) - 1
    policy = parse_policy(json.dumps({"output": [{"category": "x", "pattern": "oomb"}]}))
    found = policy.first_match(text, policy.output)
    assert found is not None and text[found.start:found.end] == "o\u043emb"
