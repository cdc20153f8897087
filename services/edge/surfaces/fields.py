"""A JSON request body and its typed fields, checked: each rejection is a 400 naming the field.

Pure: bytes or a parsed object in, a value or ApiError out.  The OpenAI request rules built on
these are in services/edge/surfaces/requests.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mesh.request_limits import MAX_NAME_CHARS, template_kwargs_problem
from services.edge.errors import ApiError, shown

# A \uD800-\uDFFF escape may leave a lone surrogate in a parsed string, which cannot travel as UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body -> a JSON object, or a 400 that says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:       # JSONDecodeError, NaN/Infinity, integers over 4300 digits
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_type")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "request body holds an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF)",
                           code="invalid_encoding") from None
    return body


def number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"'{name}' must be a number, got {type(value).__name__}", name, code="invalid_type")
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo:g} and {hi:g}, got {shown(value)}", name)
    return float(value)


def integer(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)                  # 2.0 is the integer 2 in JSON Schema, and to OpenAI's API
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {type(value).__name__}", name, code="invalid_type")
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {shown(value)}", name)
    return value


def boolean(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """`name`'s value; `default` when it is absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean, got {type(value).__name__}", name, code="invalid_type")
    return value


MAX_TOKEN_ID = (1 << 32) - 1        # uint32, as the mesh carries token ids


def is_token_id(value: Any) -> bool:
    """An integer (not a boolean) the mesh can carry as a token id; the engine checks it against the vocabulary."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def string(body: dict[str, Any], name: str, required: bool = False, max_len: int = MAX_NAME_CHARS) -> str:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"you must provide a '{name}' parameter", name, code="missing_required_parameter")
        return ""
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string, got {type(value).__name__}", name, code="invalid_type")
    if len(value) > max_len:
        raise ApiError(400, f"'{name}' is longer than {max_len} characters", name)
    return value


def no_unknown(body: dict[str, Any], allowed: set[str], where: str = "") -> None:
    """400 on the first field not in `allowed`; `where` prefixes nested names (`messages[0].`)."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        listed = ", ".join(shown(where + k) for k in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise ApiError(400, f"unrecognized request argument supplied: {listed}",
                       where + unknown[0], code="unknown_parameter")


REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def template_kwargs(body: dict[str, Any]) -> str:
    """`chat_template_kwargs` (vLLM's: enable_thinking, ...) and `reasoning_effort` (OpenAI's, given to the
    template as that variable): the chat template's variables as JSON text ("" for none)."""
    variables, effort = body.get("chat_template_kwargs"), body.get("reasoning_effort")
    if variables is None and effort is None:
        return ""
    problem = template_kwargs_problem({} if variables is None else variables)
    if problem:
        raise ApiError(400, problem, "chat_template_kwargs")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise ApiError(400, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
        variables = {**(variables or {}), "reasoning_effort": effort}
    return json.dumps(variables)
