"""Tool calls in the other families' formats (mesh/tools.py: bare_calls, CallParser): Llama 3.1's JSON calls and
built-in `<|python_tag|>` calls, Mistral's `[TOOL_CALLS]` lists (old and new form).  Each answer is written the
way those models' chat templates render an assistant's past calls (the format they are trained to answer in),
here by small templates of each family's style rendered in transformers' template environment."""

from __future__ import annotations

import json

import pytest

from mesh.tools import CallParser, bare_calls, parse
from services.tokenizer.template import ChatTemplate

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time", "brave_search")]
NAMES = {"get_weather", "get_time", "brave_search"}
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
         {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]
# How each family's template writes an assistant turn's tool calls (the style of the official templates).
LLAMA31 = """{%- for m in messages %}{%- if m.tool_calls %}{%- for c in m.tool_calls -%}
{{ {"name": c.function.name, "parameters": c.function.arguments} | tojson }}{% if not loop.last %}; {% endif %}
{%- endfor %}{%- endif %}{%- endfor %}"""
MISTRAL_V3 = """{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS] [
{%- for c in m.tool_calls %}{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
{%- if not loop.last %}, {% endif %}{%- endfor %}]{%- endif %}{%- endfor %}"""
MISTRAL_V11 = """{%- for m in messages %}{%- if m.tool_calls %}{%- for c in m.tool_calls -%}
[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{%- endfor %}{%- endif %}{%- endfor %}"""


def rendered(source: str, calls: list[dict[str, object]]) -> str:
    return ChatTemplate(source, {}).render([{"role": "assistant", "content": "", "tool_calls": calls}], None, False)


@pytest.mark.parametrize("source", [LLAMA31, MISTRAL_V3, MISTRAL_V11], ids=["llama3.1", "mistral-v3", "mistral-v11"])
@pytest.mark.parametrize("count", [1, 2])
def test_a_familys_rendered_calls_parse_back(source: str, count: int) -> None:
    text = rendered(source, CALLS[:count])
    calls = bare_calls(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in CALLS[:count]], text
    # The same streamed in pieces through the edge's parser: calls at the end, no text.
    parser = CallParser(TOOLS)
    pieces = [p for i in range(0, len(text), 5) for p in parser.feed(text[i:i + 5])] + parser.finish()
    assert [p.name for p in pieces if not isinstance(p, str)] == [c["function"]["name"] for c in CALLS[:count]]
    assert not [p for p in pieces if isinstance(p, str)]
    # Mistral's [TOOL_CALLS] is a control token: the router's decoder drops it, the list comes bare.
    if source == MISTRAL_V3:
        assert len(bare_calls(text.replace("[TOOL_CALLS]", ""), NAMES)) == count


def test_llamas_built_in_tool_call_after_the_python_tag() -> None:
    calls = bare_calls('<|python_tag|>brave_search.call(query="weather in Paris", count=3)', NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("brave_search", {"query": "weather in Paris",
                                                                                    "count": 3})]
    assert bare_calls('<|python_tag|>{"name": "get_time", "parameters": {}}', NAMES)[0].name == "get_time"


@pytest.mark.parametrize("text", ["[1] is a citation, not a call.", "{not json}", '{"name": "rm_rf", "parameters": {}}',
                                  '[{"name": "get_weather", "arguments": {}}, {"name": "unknown", "arguments": {}}]',
                                  "<|python_tag|>os.system.call('x')", 'get_weather.call(__import__("os"))'])
def test_answers_that_are_not_only_known_calls_stay_text(text: str) -> None:
    content, calls = parse(text, TOOLS)
    assert calls == [] and content == text
