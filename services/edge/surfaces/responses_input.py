"""The Responses API's request (POST /v1/responses) as the chat completion it runs as.  Pure; every rejection an
ApiError(400) naming the Responses field.

`input` (a string, or items: messages with text parts, `function_call` items echoed back, and
`function_call_output` items; `reasoning` items echoed back are dropped, as the think-tag templates drop past
thoughts) with `instructions` first becomes chat `messages`; `tools` (the Responses shape:
name, description and parameters at the top) become chat tools; `text.format` becomes `response_format`;
`max_output_tokens` is `max_tokens`.  What the answer echoes back (instructions, tools, metadata, ...) is kept
beside it.  The chat parser (services/edge/surfaces/requests.py) then checks the rest as for any chat request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mesh.sampling import Sampling
from services.edge.errors import ApiError
from services.edge.surfaces.fields import MAX_NAME_CHARS, boolean, no_unknown, string

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "max_output_tokens",
          "temperature", "top_p", "stream", "store", "previous_response_id", "metadata", "user", "reasoning"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
DEFAULT = Sampling()
MAX_METADATA = 16             # key-value pairs, as OpenAI allows


@dataclass(frozen=True)
class ResponsesRequest:
    chat: dict[str, Any]                 # the chat completions body it runs as
    stream: bool
    store: bool
    previous: str                        # previous_response_id, or ""
    echo: dict[str, Any]                 # the request's own fields the response object carries


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(text, str) or part.get("type") not in TEXT_PARTS:
                raise ApiError(400, f"'{where}[{j}]' must be {{\"type\": \"input_text\", \"text\": STRING}}; only "
                               "text is supported", f"{where}[{j}]")
            out.append(text)
        return "".join(out)
    raise ApiError(400, f"'{where}' must be a string or a list of text parts", where, code="invalid_type")


def _item(item: Any, i: int, messages: list[dict[str, Any]]) -> None:
    """Append input item i to the chat messages (consecutive function calls: one assistant message)."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise ApiError(400, f"'{where}' must be an object", where, code="invalid_type")
    kind = item.get("type", "message")
    if kind == "message":
        no_unknown(item, {"type", "role", "content", "id", "status"}, f"{where}.")
        given = item.get("role")
        role = ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise ApiError(400, f"'{where}.role' must be user, assistant, system or developer", f"{where}.role")
        messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        no_unknown(item, {"type", "call_id", "name", "arguments", "id", "status"}, f"{where}.")
        for name in ("call_id", "name", "arguments"):
            string(item, name, required=True, max_len=1 << 20)
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
            messages[-1]["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        no_unknown(item, {"type", "call_id", "output", "id", "status"}, f"{where}.")
        messages.append({"role": "tool", "tool_call_id": string(item, "call_id", required=True),
                         "content": _text(item.get("output"), f"{where}.output")})
    elif kind == "reasoning":
        # An earlier answer's thoughts, sent back as clients do: dropped, as the think-tag templates drop them.
        no_unknown(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, f"{where}.")
    else:
        raise ApiError(400, f"'{where}.type' {str(kind)[:40]!r} is not supported; use message, function_call, "
                       "function_call_output or reasoning", f"{where}.type")


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of function tools", "tools", code="invalid_type")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ApiError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"name\": ..., \"parameters\": ...}}; "
                           "only function tools are supported", f"tools[{i}]")
        no_unknown(t, {"type", "name", "description", "parameters", "strict"}, f"tools[{i}].")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if k in t}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ApiError(400, "'text' must be an object, e.g. {\"format\": {\"type\": \"json_schema\", ...}}", "text")
    no_unknown(text, {"format", "verbosity"}, "text.")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'text.format.type' must be text, json_object or json_schema", "text.format")
    if fmt["type"] != "json_schema":
        no_unknown(fmt, {"type"}, "text.format.")
        return {"type": fmt["type"]}
    no_unknown(fmt, {"type", "name", "schema", "strict", "description"}, "text.format.")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    no_unknown(body, FIELDS)
    model = string(body, "model", required=True)
    raw = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = string(body, "instructions", max_len=1 << 20)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw, str) and raw:
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        for i, item in enumerate(raw):
            _item(item, i, messages)
    else:
        raise ApiError(400, "'input' must be a non-empty string or a non-empty list of input items", "input",
                       code="missing_required_parameter" if raw is None else "invalid_type")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise ApiError(400, f"'metadata' must be at most {MAX_METADATA} string pairs (keys up to 64 characters, "
                       "values up to 512)", "metadata")
    previous = string(body, "previous_response_id", max_len=MAX_NAME_CHARS)
    chat: dict[str, Any] = {"model": model, "messages": messages}
    for field, value in (("tools", _tools(body.get("tools"))), ("tool_choice", _tool_choice(body.get("tool_choice"))),
                         ("parallel_tool_calls", body.get("parallel_tool_calls")),
                         ("response_format", _format(body.get("text"))),
                         ("max_tokens", body.get("max_output_tokens")), ("temperature", body.get("temperature")),
                         ("top_p", body.get("top_p"))):
        if value is not None:
            chat[field] = value
    string(body, "user")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise ApiError(400, "'reasoning' must be an object, e.g. {\"effort\": \"low\"}", "reasoning")
        no_unknown(reasoning, {"effort", "summary"}, "reasoning.")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]         # given to the template (fields.py)
    store = boolean(body, "store", True)
    echo = {"instructions": instructions or None, "metadata": metadata or {}, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls")
            is not False, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", DEFAULT.temperature), "top_p": body.get("top_p", DEFAULT.top_p),
            "text": body.get("text") or {"format": {"type": "text"}}, "previous_response_id": previous or None,
            "store": store, "user": body.get("user"), "reasoning": reasoning or {}}
    return ResponsesRequest(chat, boolean(body, "stream"), store, previous, echo)


def schemas(common: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI schemas of POST /v1/responses' body and answer (services/edge/surfaces/openapi.py; `common`: the
    chat fields' schemas, whose sampling fields the body shares): the types the parser enforces; items, tools and
    text are checked further by it (a 400 naming the field)."""
    def nullable(kind: str, **rules: Any) -> dict[str, Any]:
        return {"type": [kind, "null"], **rules}

    request = {"type": "object", "additionalProperties": False, "required": ["model", "input"], "properties": {
        "model": {"type": "string", "maxLength": MAX_NAME_CHARS},
        "input": {"anyOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "items": {"type": "object"}}],
                  "description": "text, or items: messages, function_call, function_call_output, reasoning"},
        "instructions": nullable("string"), "tools": nullable("array", items={"type": "object"}),
        "tool_choice": {"description": "none, auto, required or {\"type\": \"function\", \"name\": ...}"},
        "parallel_tool_calls": nullable("boolean"), "text": nullable("object"),
        "max_output_tokens": common["max_tokens"], "temperature": common["temperature"], "top_p": common["top_p"],
        "stream": nullable("boolean"), "store": nullable("boolean"),
        "previous_response_id": nullable("string", maxLength=MAX_NAME_CHARS),
        "metadata": nullable("object", maxProperties=MAX_METADATA,
                             additionalProperties={"type": "string", "maxLength": 512}),
        "user": nullable("string", maxLength=MAX_NAME_CHARS), "reasoning": nullable("object")}}
    reply = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
             "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                            "status": {"enum": ["completed", "incomplete", "in_progress"]},
                            "output": {"type": "array", "items": {"type": "object"}}}}
    return {"ResponseRequest": request, "Response": reply}
