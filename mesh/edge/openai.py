"""OpenAI request parsing and response shapes.  Pure: JSON in, GenerateSpec / JSON out.

Field names, defaults and error wording follow the OpenAI API, so the `openai` package and
curl users see what they expect.  Every rejection raises BadRequest with the field's name.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from mesh.chat import ROLES, Message
from mesh.client import Delta, GenerateSpec, Sampling, ServedBy

MAX_STOP = 4
MAX_MESSAGES = 2_048

# Accepted for compatibility; they change nothing here (a non-default value is refused below).
_IGNORED = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "store": None,
            "metadata": None, "service_tier": None, "parallel_tool_calls": None}
_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "max_tokens",
           "stop", "n", "user", "ignore_eos", "logprobs", "top_logprobs", *_IGNORED}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = "invalid_value", retry_after_s: int = 0):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.retry_after_s = retry_after_s      # > 0: sent as a Retry-After header (429, 503)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{name}' must be a number, got {type(value).__name__}", name, code="invalid_type")
    if not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be between {lo:g} and {hi:g}, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer, got {type(value).__name__}", name, code="invalid_type")
    if not lo <= value <= hi:
        raise BadRequest(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean, got {type(value).__name__}", name, code="invalid_type")
    return value


def _string(body: dict[str, Any], name: str, required: bool = False, max_len: int = 256) -> str:
    value = body.get(name)
    if value is None:
        if required:
            raise BadRequest(f"you must provide a '{name}' parameter", name, code="missing_required_parameter")
        return ""
    if not isinstance(value, str):
        raise BadRequest(f"'{name}' must be a string, got {type(value).__name__}", name, code="invalid_type")
    if len(value) > max_len:
        raise BadRequest(f"'{name}' is longer than {max_len} characters", name)
    return value


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unrecognized request argument supplied: {', '.join(unknown)}", unknown[0],
                         code="unknown_parameter")
    for name, neutral in _IGNORED.items():
        if body.get(name) not in (None, neutral, {}, []) and neutral is not None:
            raise BadRequest(f"'{name}' is not supported; leave it at {neutral}", name)
    n = _integer(body, "n", 1, 128)
    if n not in (None, 1):
        raise BadRequest("'n' must be 1: one choice per request is supported", "n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise BadRequest("'logprobs' is not supported yet", "logprobs")


def _sampling(body: dict[str, Any], max_tokens_field: str = "max_tokens") -> Sampling:
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest("'stop' must be a string or a list of strings", "stop", code="invalid_type")
    if len(stops) > MAX_STOP:
        raise BadRequest(f"'stop' holds at most {MAX_STOP} sequences", "stop")
    max_tokens = _integer(body, max_tokens_field, 1, 1 << 20)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = _integer(body, "max_tokens", 1, 1 << 20)
    return Sampling(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, 1 << 20) or 0,
        seed=_integer(body, "seed", -(1 << 63), (1 << 63) - 1),
        max_tokens=max_tokens or 0,
        ignore_eos=_boolean(body, "ignore_eos"),
        stop=stops,
    )


def stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)"""
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options", code="invalid_type")
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, _boolean(options, "include_usage")


def _content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content[{j}] must be a text part; only text is supported",
                                 f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts",
                     f"messages[{i}].content", code="invalid_type")


def parse_chat(body: dict[str, Any], session_id: str = "", pinned: str = "") -> GenerateSpec:
    _check_fields(body, CHAT_FIELDS)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if len(raw) > MAX_MESSAGES:
        raise BadRequest(f"'messages' holds at most {MAX_MESSAGES} messages", "messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}",
                             f"messages[{i}].role")
        messages.append(Message(role, _content(m, i), m.get("name") or ""))
    return GenerateSpec(model=_string(body, "model", required=True), sampling=_sampling(body, "max_completion_tokens"),
                        messages=tuple(messages), session_id=session_id or _string(body, "user"),
                        pinned_replica=pinned)


def parse_completion(body: dict[str, Any], session_id: str = "", pinned: str = "") -> GenerateSpec:
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string (one prompt per request)", "prompt")
    if body.get("echo") or body.get("suffix") or body.get("best_of") not in (None, 1):
        raise BadRequest("'echo', 'suffix' and 'best_of' are not supported", "echo")
    return GenerateSpec(model=_string(body, "model", required=True), sampling=_sampling(body), prompt=prompt,
                        session_id=session_id or _string(body, "user"), pinned_replica=pinned)


# -- responses -------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(final: Delta) -> dict[str, Any]:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


def _meta(served: ServedBy | None) -> dict[str, object] | None:
    return served.as_dict() if served else None


def completion_body(chat: bool, rid: str, model: str, text: str, final: Delta) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": final.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(final), "infermesh": _meta(final.served_by)}


def chunk_body(chat: bool, rid: str, model: str, text: str, finish: str | None = None,
               first: bool = False, final: Delta | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["delta"] = ({"role": "assistant", "content": text} if first else
                           {"content": text} if text or finish is None else {})
    else:
        choice["text"] = text
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": int(time.time()), "model": model, "choices": [choice]}
    if final is not None:
        body["infermesh"] = _meta(final.served_by)
    return body


def usage_chunk(chat: bool, rid: str, model: str, final: Delta) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [], "usage": usage(final),
            "infermesh": _meta(final.served_by)}


def error_body(message: str, kind: str, code: str | int | None = None, param: str | None = None
               ) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def parse_model_routing(body: dict[str, Any]) -> tuple[str, dict[str, float] | None]:
    """The admin API's PUT body -> (default version or "", canary shares or None to keep them)."""
    unknown = sorted(set(body) - {"default_version", "canary"})
    if unknown:
        raise BadRequest(f"unrecognized field(s): {', '.join(unknown)}; use default_version and/or canary",
                         unknown[0], code="unknown_parameter")
    default = _string(body, "default_version", max_len=64)
    canary = body.get("canary")
    if canary is None:
        if not default:
            raise BadRequest("give default_version and/or canary", "default_version",
                             code="missing_required_parameter")
        return default, None
    if not isinstance(canary, dict):
        raise BadRequest("'canary' must be an object of version -> share, e.g. {\"2\": 0.1}", "canary",
                         code="invalid_type")
    shares = {}
    for version, share in canary.items():
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise BadRequest(f"canary share for version {version!r} must be a number in [0, 1], got {share!r}",
                             "canary")
        shares[str(version)] = float(share)
    return default, shares
