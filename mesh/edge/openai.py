"""OpenAI request parsing and response shapes.  Pure: JSON in, GenerateSpec / JSON out.

Field names, defaults and error wording follow the OpenAI API, so the `openai` package and
curl users see what they expect.  Every rejection raises BadRequest with the field's name.
mesh/edge/openapi.py describes the same rules as a schema; keep the two in step.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from mesh.chat import ROLES, Message
from mesh.client import Delta, GenerateSpec, Sampling, ServedBy, TokenLogprob

MAX_STOP = 4
MAX_STOP_CHARS = 256            # the router's stop matcher holds back up to this much text
MAX_MESSAGES = 1_000            # default; the edge's --max-messages
MAX_NAME_CHARS = 256            # model, user, messages[].name
MAX_TOKENS = 1 << 20
MAX_TOP_LOGPROBS = 20           # chat top_logprobs; the engine's own limit (services/engine/request.py)
MAX_COMPLETION_LOGPROBS = 5     # completions `logprobs`, as in OpenAI
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)    # int64 as OpenAI documents it, and the engine's uint64

# A \uD800-\uDFFF escape may leave a lone surrogate in a parsed string, which cannot travel as UTF-8.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

# Accepted for compatibility when they are neutral; any other value is refused (they change nothing here).
_NEUTRAL_ZERO = ("frequency_penalty", "presence_penalty")
IGNORED_FIELDS = ("logit_bias", "store", "metadata", "service_tier", "parallel_tool_calls")
_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "max_tokens",
           "stop", "n", "user", "ignore_eos", *_NEUTRAL_ZERO, *IGNORED_FIELDS}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of", "logprobs"}
MESSAGE_FIELDS = {"role", "content", "name"}
# What clients echo back from an assistant reply (`message.model_dump()`): accepted when null or empty.
MESSAGE_EMPTY_FIELDS = ("refusal", "tool_calls", "function_call", "audio", "annotations", "tool_call_id")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = "invalid_value", retry_after_s: int = 0,
                 close: bool = False):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.retry_after_s = retry_after_s      # > 0: sent as a Retry-After header (429, 503)
        self.close = close                      # the request was not read to its end: close the connection


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body -> a JSON object, or a 400 that says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest("request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:       # JSONDecodeError, NaN/Infinity, integers over 4300 digits
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_type")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("request body holds an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF)",
                             code="invalid_encoding") from None
    return body


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
    if isinstance(value, float) and value.is_integer():
        value = int(value)                  # 2.0 is the integer 2 in JSON Schema, and to OpenAI's API
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


def _string(body: dict[str, Any], name: str, required: bool = False, max_len: int = MAX_NAME_CHARS) -> str:
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


def _unknown(body: dict[str, Any], allowed: set[str], where: str = "") -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unrecognized request argument supplied: {', '.join(where + k for k in unknown)}",
                         where + unknown[0], code="unknown_parameter")


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    _unknown(body, allowed)
    for name in _NEUTRAL_ZERO:
        if body.get(name) is not None:
            _number(body, name, 0.0, -2.0, 2.0)
            if body[name] != 0:
                raise BadRequest(f"'{name}' is not supported; leave it at 0", name)
    n = _integer(body, "n", 1, 128)
    if n not in (None, 1):
        raise BadRequest("'n' must be 1: one choice per request is supported", "n")


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
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
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"each 'stop' sequence is at most {MAX_STOP_CHARS} characters", "stop")
    return stops


def _sampling(body: dict[str, Any], max_tokens_field: str = "max_tokens", logprobs: bool = False,
              top_logprobs: int = 0) -> Sampling:
    # chat: max_completion_tokens, or the older max_tokens; both are checked whichever is used
    max_tokens = _integer(body, max_tokens_field, 1, MAX_TOKENS)
    legacy = _integer(body, "max_tokens", 1, MAX_TOKENS)
    max_tokens = legacy if max_tokens is None else max_tokens
    seed = _integer(body, "seed", *SEED_RANGE)
    return Sampling(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, MAX_TOKENS) or 0,
        seed=None if seed is None else seed % (1 << 64),    # the engine's seed is uint64; same seed, same map
        max_tokens=max_tokens or 0,
        ignore_eos=_boolean(body, "ignore_eos"),
        stop=_stops(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
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
    _unknown(options, {"include_usage"}, "stream_options.")
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
            if (not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str)
                    or len(part) != 2):
                raise BadRequest(f"messages[{i}].content[{j}] must be a text part {{\"type\": \"text\", \"text\": "
                                 "STRING}; only text is supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts",
                     f"messages[{i}].content", code="invalid_type")


def _message(m: Any, i: int) -> Message:
    if not isinstance(m, dict):
        raise BadRequest(f"messages[{i}] must be an object", f"messages[{i}]", code="invalid_type")
    _unknown(m, MESSAGE_FIELDS | set(MESSAGE_EMPTY_FIELDS), f"messages[{i}].")
    for name in MESSAGE_EMPTY_FIELDS:
        if m.get(name) is not None and m[name] != []:
            raise BadRequest(f"messages[{i}].{name} is not supported; only text messages are",
                             f"messages[{i}].{name}")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if not isinstance(role, str) or role not in ROLES:
        raise BadRequest(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)} (or developer)",
                         f"messages[{i}].role")
    return Message(role, _content(m, i), _string(m, "name") if "name" in m else "")


def _chat_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return logprobs, top or 0


def parse_chat(body: dict[str, Any], session_id: str = "", pinned: str = "",
               max_messages: int = MAX_MESSAGES) -> GenerateSpec:
    _check_fields(body, CHAT_FIELDS)
    model = _string(body, "model", required=True)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if len(raw) > max_messages:
        raise BadRequest(f"'messages' holds at most {max_messages} messages, got {len(raw)}", "messages")
    messages = tuple(_message(m, i) for i, m in enumerate(raw))
    logprobs, top = _chat_logprobs(body)
    return GenerateSpec(model=model, sampling=_sampling(body, "max_completion_tokens", logprobs, top),
                        messages=messages, session_id=session_id or _string(body, "user"), pinned_replica=pinned)


def parse_completion(body: dict[str, Any], session_id: str = "", pinned: str = "") -> GenerateSpec:
    _check_fields(body, COMPLETION_FIELDS)
    model = _string(body, "model", required=True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string (one prompt per request)", "prompt")
    for name, neutral in (("echo", False), ("suffix", ""), ("best_of", 1)):
        value = body.get(name)
        if value is not None and (value != neutral or type(value) is not type(neutral)):
            raise BadRequest(f"'{name}' is not supported; leave it at {neutral!r}", name)
    top = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return GenerateSpec(model=model, sampling=_sampling(body, logprobs=top is not None, top_logprobs=top or 0),
                        prompt=prompt, session_id=session_id or _string(body, "user"), pinned_replica=pinned)


# -- responses -------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(final: Delta) -> dict[str, Any]:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


def _meta(served: ServedBy | None) -> dict[str, object] | None:
    return served.as_dict() if served else None


def _lp(value: float) -> float:
    # JSON has no -Infinity; OpenAI reports impossible tokens as -9999.0.
    return value if math.isfinite(value) else -9999.0


class LogprobFormatter:
    """OpenAI's `logprobs` object for one choice, delta by delta.

    chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
    "refusal": null}.  completions: {"tokens", "token_logprobs", "top_logprobs" (one dict per token: the
    top alternatives and the chosen token), "text_offset"}; offsets count characters from the start of
    the prompt, as OpenAI's do, and run on across a stream's chunks.  A token's text is its own
    decoding, so a token that is part of a multi-byte character shows as U+FFFD."""

    def __init__(self, chat: bool, prompt_chars: int = 0):
        self.chat = chat
        self.offset = prompt_chars

    def format(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            return {"content": [{"token": e.token, "logprob": _lp(e.logprob), "bytes": list(e.token.encode()),
                                 "top_logprobs": [{"token": t.token, "logprob": _lp(t.logprob),
                                                   "bytes": list(t.token.encode())} for t in e.top]}
                                for e in entries], "refusal": None}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            top = {t.token: _lp(t.logprob) for t in e.top}
            top.setdefault(e.token, _lp(e.logprob))
            out["tokens"].append(e.token)
            out["token_logprobs"].append(_lp(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


def completion_body(chat: bool, rid: str, model: str, text: str, final: Delta,
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": final.finish_reason, "logprobs": logprobs}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(final), "infermesh": _meta(final.served_by)}


def chunk_body(chat: bool, rid: str, model: str, text: str, finish: str | None = None,
               first: bool = False, final: Delta | None = None, logprobs: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
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
