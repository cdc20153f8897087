"""OpenAI's `response_format`, `tools` and `tool_choice`, and the regex / grammar extensions: a parsed
body -> the constraint the engine enforces and the tools the chat template renders.  Pure; every
rejection is an ApiError(400) naming the field.

- `response_format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}}: the answer is JSON of that shape (enforced whether or
  not `strict` is set).
- Extensions, as SGLang and llama.cpp's server name them: `regex` (the whole answer matches it) and
  `grammar` (an EBNF grammar in GBNF style, `root ::= ...`).  At most one constraint per request.
- `tools` (functions) and `tool_choice`: "none" (tools not shown, answer is text), "auto" (the default
  with tools: the model may call), "required" (exactly one call, constrained), or {"type": "function",
  "function": {"name": N}} (one call of N, constrained).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mesh import tools as tool_calls
from mesh.constraints import MAX_CONSTRAINT_CHARS, Constraint
from services.edge.errors import ApiError, shown
from services.edge.surfaces.fields import boolean, no_unknown

CONSTRAINT_FIELDS = ("response_format", "regex", "grammar")
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True)
class Structured:
    constraint: Constraint | None = None
    tools: tuple[dict[str, Any], ...] = ()   # rendered for the model (empty with tool_choice "none")
    parse_calls: bool = False                # read tool calls out of the answer
    parallel: bool = True                    # parallel_tool_calls: more than one call may be returned

    @property
    def tools_json(self) -> str:
        return json.dumps(list(self.tools)) if self.tools else ""


def _size_checked(text: str, field: str) -> str:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ApiError(400, f"'{field}' is longer than {MAX_CONSTRAINT_CHARS} characters", field)
    return text


def _schema_checked(schema: dict[str, Any], field: str) -> None:
    """`schema`, once it is a JSON Schema (the 2020-12 meta-schema, by jsonschema): a malformed one is a 400 here,
    never a grammar compiler's failure in an engine.  (jsonschema is imported at the first schema: the edge
    starts fast.)"""
    from jsonschema import Draft202012Validator, SchemaError
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "".join(f"[{p!r}]" for p in exc.path)
        raise ApiError(400, f"'{field}' is not a valid JSON Schema: at {where or 'the top'}: {exc.message[:200]}",
                       field, code="invalid_schema") from None
    except RecursionError:
        raise ApiError(400, f"'{field}' is nested too deeply", field, code="invalid_schema") from None


def _response_format(value: Any) -> Constraint | None:
    field = "response_format"
    if not isinstance(value, dict):
        raise ApiError(400, "'response_format' must be an object such as {\"type\": \"json_object\"}", field,
                       code="invalid_type")
    kind = value.get("type")
    if kind == "text":
        no_unknown(value, {"type"}, "response_format.")
        return None
    if kind == "json_object":
        no_unknown(value, {"type"}, "response_format.")
        return Constraint("json_object")
    if kind != "json_schema":
        raise ApiError(400, f"'response_format.type' {shown(repr(kind))} is not one of text, json_object, "
                       "json_schema", "response_format.type")
    no_unknown(value, {"type", "json_schema"}, "response_format.")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "'response_format.json_schema' must be an object with 'name' and 'schema'",
                       "response_format.json_schema", code="invalid_type")
    no_unknown(spec, {"name", "schema", "strict", "description"}, "response_format.json_schema.")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ApiError(400, "'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'",
                       "response_format.json_schema.name")
    boolean(spec, "strict")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise ApiError(400, "'response_format.json_schema.schema' must be a JSON Schema object",
                       "response_format.json_schema.schema", code="invalid_type")
    text = _size_checked(json.dumps(schema), "response_format.json_schema.schema")
    _schema_checked(schema, "response_format.json_schema.schema")
    return Constraint("json_schema", text)


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}",
                       "tools", code="invalid_type")
    if len(value) > tool_calls.MAX_TOOLS:
        raise ApiError(400, f"'tools' holds at most {tool_calls.MAX_TOOLS} tools", "tools")
    out, seen = [], set()
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ApiError(400, f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        no_unknown(t, {"type", "function"}, f"{where}.")
        f = t["function"]
        no_unknown(f, {"name", "description", "parameters", "strict"}, f"{where}.function.")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ApiError(400, f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'",
                           f"{where}.function.name")
        if name in seen:
            raise ApiError(400, f"'{where}.function.name' {name!r} is given twice", f"{where}.function.name")
        seen.add(name)
        if "description" in f and not isinstance(f["description"], str):
            raise ApiError(400, f"'{where}.function.description' must be a string", f"{where}.function.description")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"'{where}.function.parameters' must be a JSON Schema object",
                           f"{where}.function.parameters", code="invalid_type")
        if params is not None:
            _schema_checked(params, f"{where}.function.parameters")
        boolean(f, "strict")
        out.append({"type": "function", "function": {k: f[k] for k in ("name", "description", "parameters")
                                                     if f.get(k) is not None}})
    _size_checked(json.dumps(out), "tools")
    return tuple(out)


def tools_json(value: Any) -> str:
    """A request's `tools` as the template gets them (JSON text; "" for none)."""
    return Structured(tools=_tools(value)).tools_json if value is not None else ""


def _tool_choice(value: Any, names: set[str]) -> tuple[str, str]:
    """(mode, function name): mode none | auto | required | named."""
    if value is None:
        return ("auto" if names else "none"), ""
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ApiError(400, f"'tool_choice' {shown(repr(value))} is not none, auto, required or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if value != "none" and not names:
            raise ApiError(400, f"'tool_choice' {value!r} needs 'tools'", "tool_choice")
        return value, ""
    if (not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict)
            or not isinstance(value["function"].get("name"), str)):
        raise ApiError(400, "'tool_choice' must be none, auto, required or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice", code="invalid_type")
    name = value["function"]["name"]
    if name not in names:
        raise ApiError(400, f"'tool_choice' names {shown(repr(name))}, which is not in 'tools'", "tool_choice")
    return "named", name


def parse(body: dict[str, Any], chat: bool) -> Structured:
    """The request's constraint and tools (completions take no tools)."""
    constraints: list[tuple[str, Constraint]] = []
    if body.get("response_format") is not None:
        c = _response_format(body["response_format"])
        if c is not None:
            constraints.append(("response_format", c))
    for field in ("regex", "grammar"):
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ApiError(400, f"'{field}' must be a non-empty string", field, code="invalid_type")
        constraints.append((field, Constraint(field, _size_checked(value, field))))
    if len(constraints) > 1:
        raise ApiError(400, f"give at most one of {', '.join(CONSTRAINT_FIELDS)}; got "
                       f"{', '.join(f for f, _ in constraints)}", constraints[1][0])
    constraint = constraints[0][1] if constraints else None
    if not chat:
        return Structured(constraint)
    tools = _tools(body["tools"]) if body.get("tools") is not None else ()
    mode, name = _tool_choice(body.get("tool_choice"), {t["function"]["name"] for t in tools})
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls", code="invalid_type")
    if mode == "none":
        return Structured(constraint)
    if mode in ("required", "named"):
        if constraint is not None:
            raise ApiError(400, f"'tool_choice' {mode} fixes the answer to a tool call; drop "
                           f"'{constraints[0][0]}'", "tool_choice")
        constraint = tool_calls.call_constraint(tools, name)
    elif constraint is None:      # auto: free text, but any call the model opens is a valid one
        constraint = tool_calls.auto_constraint(tools)
    return Structured(constraint, tools, parse_calls=True, parallel=parallel is not False)
