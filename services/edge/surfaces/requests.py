"""OpenAI requests: a parsed JSON body -> GenerateSpec.  Pure; every rejection is an ApiError(400)
naming the field.

Field names, defaults and error wording follow the OpenAI API, so the `openai` package and
curl users see what they expect.  services/edge/surfaces/openapi.py describes the same rules as a schema;
keep the two in step.  The response shapes are in services/edge/surfaces/responses.py.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from mesh.chat import ROLES, Message
from mesh.clients.router_client import GenerateSpec, Sampling
from mesh.sampling import JSON_FIELDS, MAX_TOP_LOGPROBS, SPECS, Spec, problem, value_problem
from services.edge.errors import ApiError, shown
from services.edge.surfaces import fields, structured
from services.edge.surfaces.fields import MAX_NAME_CHARS, boolean, integer, no_unknown, number, string, template_kwargs

T = TypeVar("T", bound=tuple[Any, ...])
MAX_MESSAGES = 1_000            # default; the edge's --max-messages
MAX_COMPLETION_LOGPROBS = 5     # completions `logprobs`, as in OpenAI

# Accepted and ignored: they change nothing about the answer (bookkeeping for OpenAI's own platform).
IGNORED_FIELDS = ("store", "metadata", "service_tier")
# The sampling fields (mesh/sampling.py: JSON_FIELDS) and the request's own.
_COMMON = {"model", "stream", "stream_options", "n", "user", *(name for name, _, _ in JSON_FIELDS), *IGNORED_FIELDS}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs",
                         "reasoning_effort", *structured.CONSTRAINT_FIELDS, *structured.TOOL_FIELDS}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of", "logprobs", *structured.CONSTRAINT_FIELDS}
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}
# What clients echo back from an assistant reply (`message.model_dump()`): accepted when null or empty.
MESSAGE_EMPTY_FIELDS = ("refusal", "function_call", "audio", "annotations")
MAX_N = 16                      # choices per prompt (`n`)
MAX_PROMPTS = 32                # prompts in one completions request


# Headers that name one thing: a second copy is refused, not silently preferred (last-wins would let
# a proxy and a client disagree about who is calling).  Values: the `user` field's bound.
SINGLE_HEADERS = {"authorization": 0, "x-session-id": MAX_NAME_CHARS, "x-infermesh-replica": MAX_NAME_CHARS,
                  "x-infermesh-model-version": 64}


def check_headers(raw: list[tuple[bytes, bytes]]) -> None:
    """400 for a second Authorization (or session, replica, version) header, or an over-long value."""
    seen: set[str] = set()
    for name, value in raw:
        header = name.decode("latin-1").lower()
        limit = SINGLE_HEADERS.get(header)
        if limit is None:
            continue
        if header in seen:
            raise ApiError(400, f"send at most one '{header}' header", header, code="duplicate_header")
        seen.add(header)
        if limit and len(value) > limit:
            raise ApiError(400, f"'{header}' header is longer than {limit} characters", header)


def _check_fields(body: dict[str, Any], allowed: set[str], session_id: str) -> int:
    """n, once the fields are known ones."""
    no_unknown(body, allowed)
    n = integer(body, "n", 1, MAX_N) or 1
    if n > 1 and (session_id or body.get("user")):
        raise ApiError(400, "'n' > 1 cannot continue a session (x-session-id or 'user'): only one answer can "
                       "join its history; send n=1, or leave the session out", "n")
    if str(session_id or body.get("user") or "").startswith("resp_"):     # another surface's conversations
        raise ApiError(400, "a session id starting with 'resp_' would name a stored response's conversation; "
                       "continue a response with POST /v1/responses and previous_response_id", "user")
    return n


def _read(body: dict[str, Any], name: str, spec: Spec, default: Any) -> Any:
    """One sampling field (mesh/sampling.py) from the JSON body, by its spec's kind; `default` when left out."""
    if spec.kind == "number":
        assert spec.lo is not None and spec.hi is not None
        value = number(body, name, default, spec.lo, spec.hi)
        if spec.above and value <= spec.lo:
            raise ApiError(400, f"'{name}' must be above {spec.lo:g}", name)
        return value
    if spec.kind == "integer":
        assert spec.lo is not None and spec.hi is not None
        whole = integer(body, name, int(spec.lo), int(spec.hi))
        return default if whole is None else whole
    if spec.kind == "boolean":
        return boolean(body, name, default)
    return _LISTS[spec.kind](body, name, spec)


def _strings(body: dict[str, Any], name: str, spec: Spec) -> tuple[str, ...]:
    """A string or a list of strings (stop, bad_words)."""
    raw = body.get(name)
    if raw is None:
        values: tuple[str, ...] = ()
    elif isinstance(raw, str):
        values = (raw,)
    elif isinstance(raw, list) and all(isinstance(v, str) for v in raw):
        values = tuple(raw)
    else:
        raise ApiError(400, f"'{name}' must be a string or a list of strings", name, code="invalid_type")
    return _within(name, values)


def _token_ids(body: dict[str, Any], name: str, spec: Spec) -> tuple[int, ...]:
    """A list of token ids (vLLM's stop_token_ids)."""
    ids = body.get(name)
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(fields.is_token_id(i) for i in ids):
        raise ApiError(400, f"'{name}' must be a list of token ids", name, code="invalid_type")
    return _within(name, tuple(ids))


def _bias(body: dict[str, Any], name: str, spec: Spec) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias {"token id": bias}: ids as decimal strings (or ints)."""
    bias = body.get(name)
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ApiError(400, f"'{name}' must be an object of token id -> bias", name, code="invalid_type")
    assert spec.lo is not None and spec.hi is not None
    out = []
    for key, value in bias.items():
        token = key if isinstance(key, int) else int(key) if isinstance(key, str) and key.isdigit() else None
        if token is None or token >= 1 << 32:
            raise ApiError(400, f"'{name}' key {shown(repr(key))} is not a token id", name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not spec.lo <= value <= spec.hi:
            raise ApiError(400, f"'{name}' value for {shown(str(key))} must be a number within "
                           f"{spec.lo:g}-{spec.hi:g}", name)
        out.append((token, float(value)))
    return _within(name, tuple(sorted(out)))


def _within(name: str, values: T) -> T:
    why = value_problem(name, values)
    if why:
        raise ApiError(400, why, name)
    return values


_LISTS = {"strings": _strings, "token_ids": _token_ids, "bias": _bias}


def _sampling(body: dict[str, Any], max_tokens_field: str = "max_tokens", logprobs: bool = False,
              top_logprobs: int = 0) -> Sampling:
    """Every JSON sampling field of mesh/sampling.py, read by its spec; the field named in each 400."""
    values = {name: _read(body, name, spec, default) for name, spec, default in JSON_FIELDS}
    if max_tokens_field != "max_tokens":     # chat: max_completion_tokens, or the older max_tokens (both checked)
        newer = _read(body, max_tokens_field, SPECS["max_tokens"], None)
        values["max_tokens"] = values["max_tokens"] if newer is None else newer
    seed = values["seed"]
    sampling = Sampling(**{
        **values, "logprobs": logprobs, "top_logprobs": top_logprobs,
        "seed": None if seed is None else seed % (1 << 64),    # the engine's seed is uint64; same seed, same map
        # Left out (or null): the model's generation_config.json value where it has one, else the above.
        "model_defaults": tuple(name for name in ("temperature", "top_p", "top_k") if body.get(name) is None)})
    broken = problem(sampling)
    if broken:
        raise ApiError(400, broken[1], broken[0])
    return sampling


def stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)"""
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options", code="invalid_type")
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
    no_unknown(options, {"include_usage"}, "stream_options.")
    return stream, boolean(options, "include_usage")


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
                raise ApiError(400, f"messages[{i}].content[{j}] must be a text part {{\"type\": \"text\", \"text\": "
                               "STRING}; only text is supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   f"messages[{i}].content", code="invalid_type")


def _message(m: Any, i: int) -> Message:
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}] must be an object", f"messages[{i}]", code="invalid_type")
    no_unknown(m, MESSAGE_FIELDS | set(MESSAGE_EMPTY_FIELDS), f"messages[{i}].")
    for name in MESSAGE_EMPTY_FIELDS:
        if m.get(name) is not None and m[name] != []:
            raise ApiError(400, f"messages[{i}].{name} is not supported; only text messages are",
                           f"messages[{i}].{name}")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(400, f"messages[{i}].role {shown(repr(role))} is not one of {', '.join(ROLES)} (or developer)",
                       f"messages[{i}].role")
    calls = m.get("tool_calls")
    has_calls = calls is not None and calls != []     # null and [] say none; any other value must be a list of calls
    if has_calls and role != "assistant":
        raise ApiError(400, f"messages[{i}].tool_calls is only for assistant messages", f"messages[{i}].tool_calls")
    call_id = m.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise ApiError(400, f"messages[{i}] (role tool) needs 'tool_call_id', the id of the call it answers",
                       f"messages[{i}].tool_call_id")
    if call_id is not None and role != "tool":
        raise ApiError(400, f"messages[{i}].tool_call_id is only for tool messages", f"messages[{i}].tool_call_id")
    return Message(role, _content(m, i), string(m, "name") if "name" in m else "",
                   _tool_calls(calls, i) if has_calls else "", call_id or "")


def parse_messages(raw: Any, max_messages: int = MAX_MESSAGES) -> tuple[Message, ...]:
    """A request's `messages`: a non-empty list of at most `max_messages` chat messages."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    if len(raw) > max_messages:
        raise ApiError(400, f"'messages' holds at most {max_messages} messages, got {len(raw)}", "messages")
    return tuple(_message(m, i) for i, m in enumerate(raw))


def _tool_calls(calls: Any, i: int) -> str:
    """An assistant message's tool_calls (as a client echoes them back) -> JSON text for the template."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list", where, code="invalid_type")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if (not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str)
                or c.get("type", "function") != "function"):
            raise ApiError(400, f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                           "{\"name\": STRING, \"arguments\": JSON_STRING}}", f"{where}[{j}]")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": f["name"], "arguments": f["arguments"]}})
    return json.dumps(out)


def _chat_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    logprobs = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return logprobs, top or 0


def parse_chat(body: dict[str, Any], session_id: str = "", pinned: str = "",
               max_messages: int = MAX_MESSAGES) -> GenerateSpec:
    n = _check_fields(body, CHAT_FIELDS, session_id)
    model = string(body, "model", required=True)
    messages = parse_messages(body.get("messages"), max_messages)
    logprobs, top = _chat_logprobs(body)
    shape = structured.parse(body, chat=True)
    sampling = dataclasses.replace(_sampling(body, "max_completion_tokens", logprobs, top), constraint=shape.constraint)
    return GenerateSpec(model=model, sampling=sampling, messages=messages,
                        session_id=session_id or string(body, "user"), pinned_replica=pinned,
                        tools=shape.tools_json, n=n, template_kwargs=template_kwargs(body),
                        tool_calls="" if not shape.parse_calls else "parallel" if shape.parallel else "single")


def parse_completion(body: dict[str, Any], session_id: str = "", pinned: str = "") -> GenerateSpec:
    n = _check_fields(body, COMPLETION_FIELDS, session_id)
    model = string(body, "model", required=True)
    prompt = body.get("prompt")
    prompts = tuple(prompt) if isinstance(prompt, list) else (prompt,)
    if not prompts or len(prompts) > MAX_PROMPTS or not all(isinstance(p, str) and p for p in prompts):
        raise ApiError(400, f"'prompt' must be a non-empty string or a list of 1-{MAX_PROMPTS} non-empty strings",
                       "prompt")
    if len(prompts) > 1 and (session_id or body.get("user")):
        raise ApiError(400, "a list of prompts cannot continue a session (x-session-id or 'user')", "prompt")
    for name, neutral in (("suffix", ""), ("best_of", 1)):
        value = body.get(name)
        if value is not None and (value != neutral or type(value) is not type(neutral)):
            raise ApiError(400, f"'{name}' is not supported; leave it at {neutral!r}", name)
    top = integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    echo = boolean(body, "echo")
    if echo and body.get("truncate_prompt_tokens"):
        raise ApiError(400, "'echo' returns the whole prompt and 'truncate_prompt_tokens' cuts it: send one of them",
                       "truncate_prompt_tokens")
    # echo with max_tokens 0 (what evaluation harnesses send to score a text): the prompt and, with
    # logprobs, its tokens' logprobs; the engine makes one token, which is not returned.
    prompt_only = echo and body.get("max_tokens") == 0
    if prompt_only:
        body = {**body, "max_tokens": 1}
    shape = structured.parse(body, chat=False)
    sampling = dataclasses.replace(_sampling(body, logprobs=top is not None, top_logprobs=top or 0),
                                   constraint=shape.constraint, prompt_logprobs=echo and top is not None)
    return GenerateSpec(model=model, sampling=sampling, prompt=prompts[0], prompts=prompts, echo=echo, n=n,
                        prompt_only=prompt_only, session_id=session_id or string(body, "user"),
                        pinned_replica=pinned)


def parse_model_routing(body: dict[str, Any]
                        ) -> tuple[str, dict[str, float] | None, tuple[str, float] | None]:
    """The admin API's PUT body -> (default version or "", canary shares or None to keep them, shadow
    rule (version, share) or None to keep it; {"shadow": null} or {} ends it)."""
    unknown = sorted(set(body) - {"default_version", "canary", "shadow"})
    if unknown:
        raise ApiError(400, f"unrecognized field(s): {shown(', '.join(unknown))}; use default_version, canary "
                       "and/or shadow", unknown[0], code="unknown_parameter")
    default = string(body, "default_version", max_len=64)
    shadow = None
    if "shadow" in body:
        rule = body["shadow"] or {}
        version, share = rule.get("version", "") if isinstance(rule, dict) else None, \
            rule.get("share", 0) if isinstance(rule, dict) else None
        if not isinstance(version, str) or isinstance(share, bool) or not isinstance(share, int | float) or \
                (version and not 0 < share <= 1) or set(rule) - {"version", "share"}:
            raise ApiError(400, "'shadow' must be {\"version\": V, \"share\": S} with S in (0, 1], or null to end "
                           "it", "shadow", code="invalid_type")
        shadow = (version, float(share))
    canary = body.get("canary")
    if canary is None:
        if not default and shadow is None:
            raise ApiError(400, "give default_version, canary and/or shadow", "default_version",
                           code="missing_required_parameter")
        return default, None, shadow
    if not isinstance(canary, dict):
        raise ApiError(400, "'canary' must be an object of version -> share, e.g. {\"2\": 0.1}", "canary",
                       code="invalid_type")
    shares = {}
    for version, share in canary.items():
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise ApiError(400, f"canary share for version {shown(repr(version))} must be a number in [0, 1], "
                           f"got {shown(repr(share))}",
                           "canary")
        shares[str(version)] = float(share)
    return default, shares, shadow
