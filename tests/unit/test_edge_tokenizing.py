"""POST /tokenize and /detokenize bodies (services/edge/surfaces/tokenizing.py): what each becomes, and the 400 that
names the field for what it refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.edge.errors import ApiError
from services.edge.surfaces.tokenizing import MAX_IDS, parse_detokenize, parse_tokenize

CHAT = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def refused(parse: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(body)
    assert err.value.status == 400
    return err.value


def test_a_prompt_adds_the_tokenizers_special_tokens_unless_told_not_to() -> None:
    spec = parse_tokenize({"prompt": "Hello", "model": "m"})
    assert (spec.model, spec.prompt, spec.messages, spec.add_special_tokens, spec.return_token_strs) == \
        ("m", "Hello", None, True, False)
    assert not parse_tokenize({"prompt": "", "add_special_tokens": False}).add_special_tokens
    assert parse_tokenize({"prompt": "x", "return_token_strs": True}).return_token_strs


def test_messages_go_through_the_template_with_tools_and_the_assistants_opening() -> None:
    spec = parse_tokenize({"messages": CHAT, "tools": [TOOL]})
    assert spec.prompt is None and spec.messages is not None and spec.messages[0].content == "Hi"
    assert spec.add_generation_prompt and not spec.add_special_tokens
    assert json.loads(spec.tools)[0]["function"]["name"] == "get_weather"
    assert not parse_tokenize({"messages": CHAT, "add_generation_prompt": False}).add_generation_prompt
    assert parse_tokenize({"messages": CHAT, "add_special_tokens": False, "prompt": None}).tools == ""


@pytest.mark.parametrize("body, field, words", [
    ({}, "prompt", "exactly one of"),
    ({"prompt": "a", "messages": CHAT}, "messages", "exactly one of"),
    ({"prompt": 3}, "prompt", "must be a string"),
    ({"prompt": "a", "tools": [TOOL]}, "tools", "is for 'messages'"),
    ({"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt", "is for 'messages'"),
    ({"messages": CHAT, "add_special_tokens": True}, "add_special_tokens", "template places"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "is not one of"),
    ({"messages": [{"role": "assistant", "tool_calls": 0.0}]}, "messages[0].tool_calls", "must be a list"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0]", "must be"),
    ({"prompt": "a", "echo": True}, "echo", "echo"),
    ({"prompt": "a", "return_token_strs": "yes"}, "return_token_strs", "boolean"),
    ({"prompt": "a", "model": 7}, "model", "string"),
])
def test_tokenize_refuses_naming_the_field(body: dict[str, Any], field: str, words: str) -> None:
    err = refused(parse_tokenize, body)
    assert err.param == field and words in err.message, (err.param, err.message)


def test_detokenize_takes_a_list_of_ids() -> None:
    assert parse_detokenize({"tokens": [0, 5, (1 << 32) - 1], "model": "m"}) == ("m", [0, 5, (1 << 32) - 1])
    assert parse_detokenize({"tokens": []}) == ("", [])
    for body, field in [({}, "tokens"), ({"tokens": "1 2"}, "tokens"), ({"tokens": [1, -1]}, "tokens[1]"),
                        ({"tokens": [True]}, "tokens[0]"), ({"tokens": [1.5]}, "tokens[0]"),
                        ({"tokens": [1 << 32]}, "tokens[0]"), ({"tokens": [0] * (MAX_IDS + 1)}, "tokens"),
                        ({"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens")]:
        assert refused(parse_detokenize, body).param == field, body
