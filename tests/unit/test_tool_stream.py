"""A tool call's arguments streamed as the model writes them (mesh/tool_stream.py, mesh/tools.py's CallParser,
services/edge/surfaces/choices.py's deltas): OpenAI's `function.arguments` pieces, the call's id, type and name in its
first piece only, and the whole call's arguments equal to the pieces joined; in the Responses API too, beside a
reasoning model's thoughts as a reasoning item."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from mesh import tools
from mesh.clients.router_client import Delta, GenerateSpec, Sampling, ServedBy
from mesh.tool_stream import CallFragment
from services.edge.surfaces.choices import Choice
from tests.fakes.edge_router import FakeRouter, asgi, edge_app

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"}}}}}
ARGS = '{"city": "Pa}ris {\\"x\\"", "days": [1, {"d": 2}]}'
ANSWER = f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\nDone.'


def fed(text: str, step: int = 1) -> list[Any]:
    parser = tools.CallParser([WEATHER])
    out: list[Any] = []
    for i in range(0, len(text), step):
        out += parser.feed(text[i:i + step])
    return out + parser.finish()


def test_the_arguments_stream_piece_by_piece_and_the_call_ends_whole() -> None:
    for step in (1, 3, 7, len(ANSWER)):
        out = fed(ANSWER, step)
        pieces = [p for p in out if isinstance(p, CallFragment)]
        calls = [p for p in out if isinstance(p, tools.ToolCall)]
        assert "".join(p.arguments for p in pieces) == ARGS, step
        assert json.loads(ARGS) == {"city": 'Pa}ris {"x"', "days": [1, {"d": 2}]}
        assert [p.first for p in pieces] == [True] + [False] * (len(pieces) - 1)
        assert {(p.id, p.name) for p in pieces} == {(calls[0].id, "get_weather")} and len(calls) == 1
        assert calls[0].arguments == ARGS
        text = "".join(p for p in out if isinstance(p, str))
        assert " ".join(text.split()) == "Let me look. Done." and "tool_call" not in text
    assert tools.parse(ANSWER, [WEATHER])[1][0].arguments == ARGS          # a whole answer: the same arguments


def test_what_is_not_a_tools_call_is_not_streamed() -> None:
    other = '<tool_call>\n{"name": "launch", "arguments": {"x": 1}}\n</tool_call>'
    out = fed(other)
    assert not [p for p in out if not isinstance(p, str)] and "".join(out) == other
    broken = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    out = fed(broken)                                   # no head to stream from: read whole at its close
    assert [type(p) for p in out] == [tools.ToolCall] and json.loads(out[0].arguments) == {"city": "Oslo"}


def spec() -> GenerateSpec:
    return GenerateSpec(model="m", sampling=Sampling(), tools=json.dumps([WEATHER]), tool_calls="parallel")


def test_chat_deltas_carry_the_call_as_openai_streams_it() -> None:
    choice = Choice(0, True, spec(), "")
    chunks = []
    cut = ANSWER.index("Pa}") + 2
    for i, part in enumerate((ANSWER[:cut], ANSWER[cut:-4], ANSWER[-4:])):
        final = i == 2
        d = Delta(part, "stop" if final else None, 5 if final else 0, 9 if final else 0)
        chunks.append(choice.delta(choice.add(d)))
    calls = [c for chunk in chunks for c in chunk.get("tool_calls", [])]
    assert calls[0]["id"] == choice.calls[0].id and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather" and {c["index"] for c in calls} == {0}
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == ARGS and len(calls) == 2
    assert choice.finish_reason == "tool_calls" and choice.body()["message"]["tool_calls"][0]["function"][
        "arguments"] == ARGS


def test_a_call_cut_by_max_tokens_finishes_length() -> None:
    """The token limit reached inside a call: finish_reason "length" (what OpenAI says), not "tool_calls",
    whose arguments a client would run; an answer whose calls closed says "tool_calls" whatever ended it."""
    for finish, text, expected in (("length", ANSWER[:ANSWER.index("Pa}") + 2], "length"),
                                   ("length", ANSWER, "tool_calls"),
                                   ("stop", ANSWER[:ANSWER.index("</tool_call>")], "tool_calls")):
        choice = Choice(0, True, spec(), "")
        choice.add(Delta(text, finish, 5, 9))
        assert choice.calls and choice.finish_reason == expected, (finish, text)


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def test_the_responses_api_streams_thoughts_and_call_arguments_in_pieces() -> None:
    served = ServedBy("engine-0", "m", "1", "local", False, 1.0)
    cut = ANSWER.index("Pa}") + 2
    router = FakeRouter([Delta("", reasoning="The user wants "), Delta("", reasoning="the weather."),
                         Delta(ANSWER[:cut]), Delta(ANSWER[cut:], "stop", 7, 30, served_by=served)])
    app = edge_app(router, response_cache_ttl_s=0)
    body = {"model": "m", "input": "Weather in Paris?", "tools": [{"type": "function", **WEATHER["function"]}]}
    status, _, raw = asyncio.run(asgi(app, "POST", "/v1/responses", json.dumps({**body, "stream": True}).encode()))
    assert status == 200
    events = sse_events(raw)
    kinds = [e["type"] for e in events]
    thoughts = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert thoughts == ["The user wants ", "the weather."]
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) == 2 and "".join(pieces) == ARGS
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "The user wants the weather."}]
    assert final["output"][2]["arguments"] == ARGS
    status, _, raw = asyncio.run(asgi(app, "POST", "/v1/responses", json.dumps(
        {**body, "input": [{"type": "reasoning", "id": "rs_1", "summary": []},
                           {"role": "user", "content": "Again?"}]}).encode()))
    assert status == 200 and json.loads(raw)["output"][0]["type"] == "reasoning"     # sent back: accepted, dropped
