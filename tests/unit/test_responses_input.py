"""The Responses API's request as a chat completion (services/edge/surfaces/responses_input.py)."""

from __future__ import annotations

from typing import Any

import pytest

from services.edge.errors import ApiError
from services.edge.surfaces.requests import parse_chat
from services.edge.surfaces.responses_input import parse_responses

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def test_items_become_chat_messages() -> None:
    request = parse_responses({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0, "store": False,
        "previous_response_id": "resp_1", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                                          "text": "in Paris?"}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                  {"type": "message", "role": "developer", "content": "Use Celsius."}]})
    chat = request.chat
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "system"]
    assert chat["messages"][1]["content"] == "Weather in Paris?"
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["call_1", "call_2"]   # one assistant turn
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather",
                                                               "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_tokens"] == 9 and not request.store and request.previous == "resp_1" and not request.stream
    spec = parse_chat(chat)                           # the chat it becomes is a valid one
    assert spec.sampling.max_tokens == 9 and spec.tools
    assert request.echo["instructions"] == "Be brief." and request.echo["tools"] == [TOOL]


def test_a_string_input_and_a_json_schema_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = parse_responses({"model": "m", "input": "Hi", "stream": True, "metadata": {"k": "v"},
                               "text": {"format": {"type": "json_schema", "name": "out", "schema": schema}}})
    assert request.chat["messages"] == [{"role": "user", "content": "Hi"}] and request.stream and request.store
    assert request.chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    assert parse_chat(request.chat).sampling.constraint is not None
    assert request.echo["metadata"] == {"k": "v"}
    effort = parse_responses({"model": "m", "input": "x", "reasoning": {"effort": "low"}})
    assert effort.chat["reasoning_effort"] == "low" and parse_chat(effort.chat).template_kwargs == \
        '{"reasoning_effort": "low"}'


@pytest.mark.parametrize("body, param", [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": ""}, "input"),
    ({"model": "m", "input": [{"type": "image"}]}, "input[0].type"),
    ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"model": "m", "input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"model": "m", "input": "x", "store": "yes"}, "store"),
    ({"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
    ({"model": "m", "input": "x", "reasoning": {"effort": "low", "budget": 3}}, "reasoning.budget"),
])
def test_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_responses(body)
    assert err.value.status == 400 and err.value.param == param, err.value.message
