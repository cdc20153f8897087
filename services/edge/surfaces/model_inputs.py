"""Every text of a request that reaches the model or forces its output: what the input rules read.

One table, `FIELDS`, names them; `texts(body)` walks a request body (already parsed and checked by
services/edge/surfaces/requests.py) and returns each text with where it came from, in the order the model sees
them.  A field added to the API that carries text to the model is added here, or the content rules
do not see it (tests/security/test_input_fields.py sends a blocked word through each one).

Structured values are read whole: every key and string of a tool's parameters or a JSON schema, and
the strings inside an assistant's tool-call arguments (JSON text) as the model may read them, escapes
decoded.  A regex or grammar is read as written: one that spells a word indirectly (`b[o]mb`,
`\\x62omb`) is not caught here, but what it makes the model write is, by the output rules.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# field -> what of it is read.  Chat messages: content (string or text parts), name, tool_calls
# (function names and arguments), tool_call_id.  Responses API fields join here when it exists.
FIELDS = {
    "messages": "each message's content, name, tool_calls (names, arguments) and tool_call_id",
    "prompt": "the prompt, or each prompt of a list",
    "suffix": "completions' suffix",
    "tools": "each tool's name, description and parameters schema (keys and strings)",
    "response_format": "the JSON schema's name, description and every key and string of the schema",
    "regex": "the regular expression, as written",
    "grammar": "the grammar, as written",
    "stop": "each stop sequence",
    "instructions": "the Responses API's instructions",
    "input": "the Responses API's input items; the embeddings' inputs",
    "chat_template_kwargs": "each variable's name and value (the template writes them into the prompt)",
}


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value: object keys and values, list items."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _json_text(text: Any) -> Iterator[str]:
    """A JSON text as written, then its strings decoded (arguments may hide a word in \\u escapes)."""
    if not isinstance(text, str):
        yield from _strings(text)
        return
    yield text
    try:
        yield from _strings(json.loads(text))
    except ValueError:
        pass


def _message(m: Any, i: int) -> Iterator[tuple[str, str]]:
    if not isinstance(m, dict):
        return
    content = m.get("content")
    parts = content if isinstance(content, list) else [{"text": content}]
    for part in parts:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            yield f"messages[{i}].content", part["text"]
    for name in ("name", "tool_call_id"):
        if isinstance(m.get(name), str):
            yield f"messages[{i}].{name}", m[name]
    for j, call in enumerate(m.get("tool_calls") or []):
        f = call.get("function") if isinstance(call, dict) else None
        if isinstance(f, dict):
            if isinstance(f.get("name"), str):
                yield f"messages[{i}].tool_calls[{j}].function.name", f["name"]
            for s in _json_text(f.get("arguments")):
                yield f"messages[{i}].tool_calls[{j}].function.arguments", s


def texts(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, text) for every text in `body` that reaches the model, in the order the model sees them."""
    out: list[tuple[str, str]] = []
    for field in ("chat_template_kwargs", "instructions", "tools", "messages", "input", "prompt", "suffix",
                  "response_format", "regex", "grammar", "stop"):
        value = body.get(field)
        if value is None:
            continue
        if field == "messages" and isinstance(value, list):
            for i, m in enumerate(value):
                out.extend(_message(m, i))
        elif field == "tools" and isinstance(value, list):
            for i, t in enumerate(value):
                f = t.get("function") if isinstance(t, dict) else None
                if isinstance(f, dict):
                    out.extend((f"tools[{i}].function", s) for s in _strings(
                        [f.get("name"), f.get("description"), f.get("parameters")]))
        else:
            out.extend((field, s) for s in _strings(value))
    return [(f, s) for f, s in out if s]
