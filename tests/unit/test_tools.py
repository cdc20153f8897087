"""Tool calls read out of answers, whole and streamed in any split; tools and calls written into prompts."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mesh import tools
from mesh.chat import Message
from mesh.errors import InvalidArgument

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "noop"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def split_feed(text: str, step: int) -> tuple[list[str | tools.ToolCall], tools.CallParser]:
    parser = tools.CallParser(TOOLS)
    out: list[str | tools.ToolCall] = []
    for i in range(0, len(text), step):
        out += parser.feed(text[i:i + step])
    return out + parser.finish(), parser


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_calls_and_text_in_any_split(step: int) -> None:
    text = f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Oslo')}"
    out, parser = split_feed(text, step)
    assert "".join(o for o in out if isinstance(o, str)).strip() == "Let me check."
    assert [json.loads(c.arguments)["city"] for c in parser.calls] == ["Paris", "Oslo"]
    assert all(c.name == "get_weather" and c.id.startswith("call_") for c in parser.calls)
    plain, _ = split_feed("No tools <tool here, just text < and >", step)
    assert "".join(o for o in plain if isinstance(o, str)) == "No tools <tool here, just text < and >"


def test_what_is_not_a_call_stays_text() -> None:
    for text in ['<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', "<tool_call>not json</tool_call>",
                 '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>']:
        content, calls = tools.parse(text, TOOLS)
        assert calls == [] and content == text
    content, calls = tools.parse(CALL[:-len("</tool_call>")], TOOLS)    # the answer ended before the closing tag
    assert content == "" and calls[0].name == "get_weather"
    content, calls = tools.parse('{"name": "noop", "parameters": {}}', TOOLS)   # a bare call (Llama 3 style)
    assert content == "" and calls[0].name == "noop" and calls[0].arguments == "{}"


def test_call_constraint_schema_accepts_only_valid_calls() -> None:
    c = tools.call_constraint(TOOLS)
    assert c.prefix == "<tool_call>\n" and c.suffix == "\n</tool_call>"
    schema = json.loads(c.text)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, schema)
    jsonschema.validate({"name": "noop", "arguments": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {}}, schema)
    named = json.loads(tools.call_constraint(TOOLS, "noop").text)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, named)


def test_auto_constraint_is_a_triggered_structural_tag() -> None:
    c = tools.auto_constraint(TOOLS)
    assert c.kind == "tool_calls" and json.loads(c.text) == TOOLS
    tag = tools.structural_tag(c.text)["format"]
    assert tag["type"] == "triggered_tags" and tag["triggers"] == ["<tool_call>"]
    assert [t["begin"] for t in tag["tags"]] == ['<tool_call>\n{"name": "get_weather", "arguments": ',
                                                 '<tool_call>\n{"name": "noop", "arguments": ']
    assert tag["tags"][0]["end"] == "}\n</tool_call>"
    assert tag["tags"][1]["content"]["json_schema"] == {"type": "object", "properties": {}}
    call = tag["tags"][0]["begin"] + '{"city": "Paris"}' + tag["tags"][0]["end"]
    assert tools.parse(call, TOOLS)[1][0].arguments == '{"city": "Paris"}'      # what it allows, the parser reads


def test_generic_messages_carry_tools_calls_and_results() -> None:
    calls = json.dumps([{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    out = tools.generic_messages([Message("user", "Weather in Paris?"), Message("assistant", "", tool_calls=calls),
                                  Message("tool", "sunny", tool_call_id="call_1")], TOOLS)
    assert [m.role for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in out[0].content and "<tools>" in out[0].content
    assert tools.parse(out[2].content, TOOLS)[1][0].arguments == '{"city": "Paris"}'
    assert out[3].content == "<tool_response>\nsunny\n</tool_response>"
    kept = tools.generic_messages([Message("system", "Be brief."), Message("user", "hi")], TOOLS)
    assert kept[0].content.startswith("Be brief.\n\n# Tools")


def test_check_refuses_malformed_tools_and_calls() -> None:
    tools.check(json.dumps(TOOLS), [])
    for bad in ("{", "[1]", json.dumps([{"function": {}}])):
        with pytest.raises(InvalidArgument, match="tools must be"):
            tools.check(bad, [])
    with pytest.raises(InvalidArgument, match=r"messages\[0\].tool_calls"):
        tools.check("", [Message("assistant", "", tool_calls='[{"function": {"name": "f"}}]')])


def test_a_call_cut_off_is_flagged_unclosed() -> None:
    """An answer that ends inside a call (max_tokens): the call is given out as written, and the parser says it
    was not closed, so the edge reports "length" rather than "tool_calls" (services/edge/surfaces/choices.py)."""
    whole = tools.CallParser(TOOLS)
    whole.feed(CALL)
    whole.finish()
    assert len(whole.calls) == 1 and not whole.unclosed
    cut = tools.CallParser(TOOLS)
    cut.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    cut.finish()
    assert cut.unclosed
