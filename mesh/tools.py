"""Tool calling: how tools and tool calls are written into a prompt, and read back out of an answer.

One format throughout, the one Hermes and Qwen models are trained on: a call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` lines.  A chat template
that knows tools (it reads a `tools` variable) renders them its own way; for one that does not,
`generic_messages` puts the tool list into the system message, earlier calls into the assistant's
text and tool results into `<tool_response>` user turns.  `tool_choice` "required" or a named function
constrains the answer to one such call (`call_constraint`, enforced by the engine's grammar).  An answer
made only of calls in Llama 3.1's or Mistral's format is read too (`bare_calls`).
Pure code: the tokenizer renders with it, the edge parses answers with it.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mesh.chat import Message
from mesh.constraints import Constraint
from mesh.errors import InvalidArgument
from mesh.tool_stream import CallFragment, OpenCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str              # JSON text of an object, as OpenAI returns it

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check(tools_json: str, messages: Sequence[Message]) -> None:
    """InvalidArgument unless the tools are a list of functions with names, and every message's tool
    calls a list of calls with a function name and JSON-text arguments (what the edge sends)."""
    try:
        tools = json.loads(tools_json) if tools_json else []
        ok = isinstance(tools, list) and len(tools) <= MAX_TOOLS and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)
    except ValueError:
        ok = False
    if not ok:
        raise InvalidArgument(f"tools must be a JSON list of at most {MAX_TOOLS} "
                              '{"type": "function", "function": {"name": ...}} objects')
    for i, m in enumerate(messages):
        if not m.tool_calls:
            continue
        try:
            calls = json.loads(m.tool_calls)
            ok = isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments"), str)
                for c in calls)
        except ValueError:
            ok = False
        if not ok:
            raise InvalidArgument(f"messages[{i}].tool_calls must be a JSON list of "
                                  '{"function": {"name": ..., "arguments": JSON_TEXT}} objects')


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _functions(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t["function"] for t in tools]


def _parameters(f: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; one that names none takes an empty object."""
    return f.get("parameters") or {"type": "object", "properties": {}}


def preamble(tools: Sequence[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(f, ensure_ascii=False) for f in _functions(tools))
    return ("# Tools\n\nYou can call functions to answer. Each function, with its parameters as JSON Schema:\n"
            f"<tools>\n{lines}\n</tools>\n\nTo call one, answer with its name and arguments as a JSON object "
            f"between tags:\n{OPEN}\n{{\"name\": \"<function name>\", \"arguments\": {{<arguments>}}}}\n{CLOSE}\n"
            "Otherwise answer in plain text.")


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it."""
    try:
        args: Any = _json(arguments) if arguments else {}
    except ValueError:
        args = arguments
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def generic_messages(messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> list[Message]:
    """The conversation for a chat template that knows nothing of tools: plain system/user/assistant turns."""
    out: list[Message] = []
    if tools:
        text = preamble(tools)
        if messages and messages[0].role == "system":
            out.append(Message("system", f"{messages[0].content}\n\n{text}", messages[0].name))
            messages = messages[1:]
        else:
            out.append(Message("system", text))
    for m in messages:
        if m.role == "tool":
            out.append(Message("user", f"<tool_response>\n{m.content}\n</tool_response>"))
        elif m.tool_calls:
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in _json(m.tool_calls))
            out.append(Message("assistant", f"{m.content}\n{calls}" if m.content else calls, m.name))
        else:
            out.append(m)
    return out


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation for a chat template that knows tools (Hugging Face's message dicts)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.get("id", ""), "type": "function", "function": {
                "name": c["function"]["name"], "arguments": _loads_or_text(c["function"]["arguments"])}}
                for c in _json(m.tool_calls)]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _json(text: str) -> Any:
    """JSON text that the tokenizer may have marked with placeholders (control characters) in its strings."""
    return json.loads(text, strict=False)


def _loads_or_text(text: str) -> Any:
    try:
        return _json(text)
    except ValueError:
        return text


def call_constraint(tools: Sequence[dict[str, Any]], name: str = "") -> Constraint:
    """The answer is exactly one call: of `name`, or of any of the tools, its arguments valid for that tool."""
    def one(f: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                "required": ["name", "arguments"], "additionalProperties": False}

    chosen = [f for f in _functions(tools) if not name or f["name"] == name]
    schema = one(chosen[0]) if len(chosen) == 1 else {"anyOf": [one(f) for f in chosen]}
    return Constraint("json_schema", json.dumps(schema), prefix=OPEN + "\n", suffix="\n" + CLOSE)


def auto_constraint(tools: Sequence[dict[str, Any]]) -> Constraint:
    """tool_choice "auto": the answer is free, but every call it makes is a valid call of one of the tools."""
    return Constraint("tool_calls", json.dumps(list(tools)))


def structural_tag(tools_json: str) -> dict[str, Any]:
    """The tool_calls constraint as an xgrammar structural tag: any text, until `<tool_call>` opens a call;
    then `{"name": N, "arguments": ARGS}` for one of the tools, ARGS valid for its parameters, and the
    closing tag; then any text again."""
    tags = [{"type": "tag", "begin": f'{OPEN}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": _parameters(f)},
             "end": f"}}\n{CLOSE}"} for f in _functions(json.loads(tools_json))]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [OPEN], "tags": tags}}


def _call(body: str, names: set[str]) -> ToolCall | None:
    """A call from the JSON between the tags (or a whole answer), or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call_of(obj, names)


def _call_of(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _loads_or_text(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


# Answers that are calls and nothing else, in the other families' formats: Llama 3.1's JSON calls (one object,
# or several separated by ";", after <|python_tag|> or not; its built-in tools' `name.call(key=value, ...)`),
# Mistral's `[TOOL_CALLS]` list of {"name", "arguments"} (the tag is a control token: the router's decoder
# drops it, so the list comes bare) or its newer `[TOOL_CALLS]name[ARGS]{...}`.
PYTHON_TAG, MISTRAL_CALLS, MISTRAL_ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"
BARE_STARTS = ("{", "[", PYTHON_TAG)
_PYTHON_CALL = re.compile(r"([A-Za-z_][\w-]*)\.call\((.*)\)", re.S)


def bare_calls(text: str, names: set[str]) -> list[ToolCall]:
    """The calls a whole answer is made of, in any family's format above ([] when it is not only calls)."""
    body = text.strip()
    for tag in (PYTHON_TAG, MISTRAL_CALLS):
        body = body.removeprefix(tag).strip()
    if MISTRAL_ARGS in body:
        parts = body.split(MISTRAL_CALLS)
        objs: list[Any] = []
        for part in parts:
            name, _, args = part.strip().partition(MISTRAL_ARGS)
            objs.append({"name": name.strip(), "arguments": _loads_or_text(args.strip())})
    else:
        objs = _json_objects(body)
    calls = [_call_of(o, names) for o in objs]
    return [c for c in calls if c is not None] if calls and all(calls) else []


def _json_objects(body: str) -> list[Any]:
    """One JSON object, a JSON list of them, objects separated by ";", or one `name.call(k=v, ...)`."""
    try:
        value = json.loads(body)
        return value if isinstance(value, list) else [value]
    except ValueError:
        pass
    python = _PYTHON_CALL.fullmatch(body)
    if python is not None:
        try:
            node = ast.parse(f"f({python.group(2)})", mode="eval").body
            assert isinstance(node, ast.Call) and not node.args
            return [{"name": python.group(1),
                     "arguments": {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}}]
        except (SyntaxError, ValueError, AssertionError):
            return []
    try:
        return [json.loads(part) for part in body.split(";") if part.strip()]
    except ValueError:
        return []


class CallParser:
    """Splits an answer, as it streams, into text and tool calls.  Text that may open a call is held back
    until it is known; a call's arguments stream as CallFragments once its head names a tool
    (mesh/tool_stream.py), and the call is given out whole when its closing tag (or the answer's end)
    arrives, its arguments the text streamed.  An answer made only of calls in another family's format (or
    one bare JSON call, the form some templates teach) is read at its end."""

    def __init__(self, tools: Sequence[dict[str, Any]]):
        self.names = {f["name"] for f in _functions(tools)}
        self._buf = ""
        self._in_call = False
        self._open: OpenCall | None = None
        self._started = False       # some non-blank text was seen
        self._bare = False          # the answer began with "{": held whole, read at the end
        self.calls: list[ToolCall] = []
        self.unclosed = False       # the answer ended inside a call (cut by max_tokens): its arguments may be too

    def feed(self, text: str) -> list[str | ToolCall | CallFragment]:
        self._buf += text
        out: list[str | ToolCall | CallFragment] = []
        if not self._started and self._buf.strip():
            self._started = True
            self._bare = self._buf.lstrip().startswith(BARE_STARTS)
        if self._bare:
            return out
        while self._buf:
            if self._in_call:
                end = self._buf.find(CLOSE)
                assert self._open is not None
                out.extend(self._open.feed(self._buf if end < 0 else self._buf[:end]))
                if end < 0:
                    break
                self._emit_call(self._buf[:end], out)
                self._buf = self._buf[end + len(CLOSE):].lstrip("\n")
                self._in_call = False
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                if self._buf[:start].strip():
                    out.append(self._buf[:start])
                self._buf = self._buf[start + len(OPEN):]
                self._in_call = True
                self._open = OpenCall(new_call_id(), self.names)
                continue
            keep = next((k for k in range(min(len(OPEN) - 1, len(self._buf)), 0, -1)
                         if OPEN.startswith(self._buf[-k:])), 0)
            out.append(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return [o for o in out if o != ""]

    def finish(self) -> list[str | ToolCall | CallFragment]:
        out: list[str | ToolCall | CallFragment] = []
        if self._bare:
            calls = bare_calls(self._buf, self.names)
            out.extend(calls or [self._buf])
            self.calls.extend(calls)
        elif self._in_call:
            self.unclosed = True
            self._emit_call(self._buf, out, unclosed=True)
        elif self._buf:
            out.append(self._buf)
        self._buf = ""
        return [o for o in out if o != ""]

    def _emit_call(self, body: str, out: list[str | ToolCall | CallFragment], unclosed: bool = False) -> None:
        opened, self._open = self._open, None
        if opened is not None and opened.started:       # streamed: the call it began, with the arguments sent
            call: ToolCall | None = ToolCall(opened.id, opened.name, opened.arguments(body))
        else:
            call = _call(body.strip(), self.names)
        if call is None:          # not a call after all: the text as written
            out.append(OPEN + body + ("" if unclosed else CLOSE))
        else:
            self.calls.append(call)
            out.append(call)


def parse(text: str, tools: Sequence[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer."""
    parser = CallParser(tools)
    parts = parser.feed(text) + parser.finish()
    return "".join(p for p in parts if isinstance(p, str)).strip() if parser.calls else text, parser.calls
