"""The edge's OpenAPI 3.1 document, served at GET /openapi.json without auth.

It states the same rules services/edge/surfaces/requests.py enforces (required fields, types, ranges, no unknown
fields), so a schema-driven fuzzer can tell a valid request from an invalid one: where the two
could differ, the schema is the more permissive (the server may still refuse, with a 4xx, what
only the router can judge: an unknown model, a prompt over the context).
"""

from __future__ import annotations

from typing import Any

from mesh import sampling
from mesh.chat import ROLES
from mesh.constraints import MAX_CONSTRAINT_CHARS
from mesh.tools import MAX_TOOLS
from services.edge.batch import openapi_batches
from services.edge.config import EdgeConfig
from services.edge.surfaces import embeddings, requests, responses_input, tokenizing
from services.edge.surfaces.fields import MAX_NAME_CHARS, REASONING_EFFORTS

JSON = "application/json"


def _nullable(kind: str, **rules: Any) -> dict[str, Any]:
    return {"type": [kind, "null"], **rules}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _common_fields() -> dict[str, Any]:
    return {
        "model": {"type": "string", "maxLength": MAX_NAME_CHARS,
                  "description": "a served model (GET /v1/models), `NAME@VERSION` to pin a version; '' is the default"},
        "stream": _nullable("boolean"),
        "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                           "properties": {"include_usage": _nullable("boolean")},
                           "description": "only with stream: true"},
        **sampling.schemas(),           # temperature, top_p, max_tokens, stop, the penalties, ... (mesh/sampling.py)
        "n": _nullable("integer", minimum=1, maximum=requests.MAX_N,
                       description="choices per prompt; the prompt is prefilled once (not with a session)"),
        "user": _nullable("string", maxLength=MAX_NAME_CHARS, description="names a session"),
        **{name: {"description": "accepted and ignored"} for name in requests.IGNORED_FIELDS},
        **_constraint_fields(),
    }


def _constraint_fields() -> dict[str, Any]:
    schema_spec = {"type": "object", "additionalProperties": False, "required": ["name"],
                   "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                                  "schema": {"type": "object"}, "strict": _nullable("boolean"),
                                  "description": {"type": "string"}}}
    formats = [{"type": "null"},
               {"type": "object", "additionalProperties": False, "required": ["type"],
                "properties": {"type": {"enum": ["text", "json_object"]}}},
               {"type": "object", "additionalProperties": False, "required": ["type", "json_schema"],
                "properties": {"type": {"const": "json_schema"}, "json_schema": schema_spec}}]
    text = _nullable("string", minLength=1, maxLength=MAX_CONSTRAINT_CHARS)
    return {"response_format": {"anyOf": formats, "description": "the answer is JSON (of this schema): enforced"},
            "regex": {**text, "description": "the answer matches this regular expression (extension)"},
            "grammar": {**text, "description": "the answer follows this EBNF grammar, `root ::= ...` (extension)"}}


def _tool_call(*required: str) -> dict[str, Any]:
    """One entry of `tool_calls` (arguments as JSON text), with these fields required."""
    return {"type": "object", "required": list(required),
            "properties": {"id": {"type": "string"}, "type": {"const": "function"}, "function": {
                "type": "object", "required": ["name", "arguments"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}


def _tool_fields() -> dict[str, Any]:
    function = {"type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                               "description": {"type": "string"}, "parameters": {"type": "object"},
                               "strict": _nullable("boolean")}}
    tool = {"type": "object", "additionalProperties": False, "required": ["type", "function"],
            "properties": {"type": {"const": "function"}, "function": function}}
    named = {"type": "object", "required": ["type", "function"],
             "properties": {"type": {"const": "function"}, "function": {
                 "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
    return {"tools": {"anyOf": [{"type": "null"}, {"type": "array", "minItems": 1, "maxItems": MAX_TOOLS,
                                                   "items": tool}]},
            "tool_choice": {"anyOf": [{"type": "null"}, {"enum": ["none", "auto", "required"]}, named],
                            "description": "required / named: the answer is one call, constrained"},
            "parallel_tool_calls": _nullable("boolean", description="false: at most one call is returned")}


def _request_schemas(config: EdgeConfig) -> dict[str, Any]:
    empty = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}],
             "description": "accepted when null or empty (echoed assistant messages)"}
    text_part = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    # content is null only for assistant messages, hence two shapes.
    call = _tool_call("function")           # as a client echoes an assistant's calls back
    fields = {"name": _nullable("string", maxLength=MAX_NAME_CHARS),
              "tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "items": call}],
                             "description": "assistant messages only"},
              "tool_call_id": {"type": "string", "description": "tool messages only (required there)"},
              **{name: empty for name in requests.MESSAGE_EMPTY_FIELDS}}
    text = [{"type": "string"}, {"type": "array", "items": text_part}]
    roles = [*(r for r in ROLES if r != "assistant"), "developer"]
    message = {"oneOf": [
        {"type": "object", "additionalProperties": False, "required": ["role", "content"],
         "properties": {"role": {"enum": roles}, "content": {"anyOf": text}, **fields}},
        {"type": "object", "additionalProperties": False, "required": ["role"],
         "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [*text, {"type": "null"}]}, **fields}},
    ]}
    common = _common_fields()
    chat = {
        "type": "object", "additionalProperties": False, "required": ["model", "messages"],
        "properties": {
            **common,
            "messages": {"type": "array", "minItems": 1, "maxItems": config.max_messages, "items": message},
            "max_completion_tokens": common["max_tokens"],
            "logprobs": _nullable("boolean"),
            "top_logprobs": sampling.json_schema(sampling.SPECS["top_logprobs"], "needs logprobs: true"),
            "chat_template_kwargs": {"type": ["object", "null"], "maxProperties": 16, "additionalProperties": {
                "type": ["boolean", "number", "string"], "maxLength": 64, "pattern": "^[A-Za-z0-9_.-]*$"},
                "description": "variables for the chat template (enable_thinking, ...): booleans, numbers, words"},
            "reasoning_effort": {"enum": [*REASONING_EFFORTS, None], "description": "given to the template"},
            **_tool_fields(),
        },
    }
    completion = {
        "type": "object", "additionalProperties": False, "required": ["model", "prompt"],
        "properties": {
            **common,
            "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "minItems": 1, "maxItems": requests.MAX_PROMPTS,
                                  "items": {"type": "string", "minLength": 1}}]},
            "logprobs": _nullable("integer", minimum=0, maximum=requests.MAX_COMPLETION_LOGPROBS,
                                  description="top-N alternatives per token"),
            "echo": _nullable("boolean", description="the prompt (with logprobs: and its tokens' logprobs) "
                                                     "before the text"),
            "max_tokens": {**common["max_tokens"], "minimum": 0, "description": "0 only with echo: the prompt alone"},
            "suffix": {"enum": ["", None]},
            "best_of": _nullable("integer", minimum=1, maximum=1),
        },
    }
    return {"ChatMessage": message, "ChatCompletionRequest": chat, "CompletionRequest": completion,
            **tokenizing.schemas(config.max_messages, _tool_fields()["tools"]), **embeddings.schemas(),
            **responses_input.schemas(common)}


def _response_schemas() -> dict[str, Any]:
    token: dict[str, Any] = {"type": "object", "required": ["token", "logprob", "bytes"],
                             "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                                            "bytes": {"type": ["array", "null"], "items": {"type": "integer"}}}}
    chat_logprobs = {"type": ["object", "null"], "required": ["content"], "properties": {"content": {
        "type": ["array", "null"], "items": {**token, "required": ["token", "logprob", "bytes", "top_logprobs"],
                                             "properties": {**token["properties"],
                                                            "top_logprobs": {"type": "array", "items": token}}}}}}
    completion_logprobs = {"type": ["object", "null"],
                           "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
                           "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                                          # null for an echoed prompt's first token, as OpenAI answers
                                          "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                                          "top_logprobs": {"type": "array", "items": {
                                              "type": ["object", "null"], "additionalProperties": {"type": "number"}}},
                                          "text_offset": {"type": "array", "items": {"type": "integer"}}}}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    meta = {"type": ["object", "null"], "required": ["replica", "model_version", "region", "degraded", "confidence"],
            "properties": {"replica": {"type": "string"}, "model_version": {"type": "string"},
                           "region": {"type": "string"}, "degraded": {"type": "boolean"},
                           "confidence": {"type": "number"}, "cached": {"type": "boolean"},
                           "degraded_by": {"type": "string", "enum": ["capacity", "latency"]},
                           "confidence_source": {"type": "string"}}}
    finish = {"type": ["string", "null"]}

    def completion(obj: str, choice: dict[str, Any], logprobs: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                               "model": {"type": "string"}, "usage": usage, "infermesh": meta,
                               "choices": {"type": "array", "items": {
                                   "type": "object", "required": ["index", "finish_reason", "logprobs"],
                                   "properties": {"index": {"type": "integer"}, "finish_reason": finish,
                                                  "logprobs": logprobs, **choice}}}}}

    def chunk(obj: str, choice: dict[str, Any], logprobs: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                               "model": {"type": "string"}, "usage": usage, "infermesh": meta,
                               "choices": {"type": "array", "items": {
                                   "type": "object", "required": ["index", "finish_reason"],
                                   "properties": {"index": {"type": "integer"}, "finish_reason": finish,
                                                  "logprobs": logprobs, **choice}}}}}

    call = _tool_call("id", "type", "function")
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                              "tool_calls": {"type": "array", "items": call}}}
    delta = {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"},
                                              "tool_calls": {"type": "array", "items": {
                                                  **call, "required": ["index", "id", "type", "function"],
                                                  "properties": {**call["properties"],
                                                                 "index": {"type": "integer"}}}}}}
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}}}
    model = {"type": "object", "required": ["id", "object", "created", "owned_by"],
             "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                            "owned_by": {"type": "string"}, "version": {"type": "string"},
                            "versions": {"type": "array", "items": {"type": "string"}},
                            "replicas": {"type": "integer"}, "max_context": {"type": "integer"},
                            "parent": {"type": ["string", "null"], "description": "a LoRA adapter's base model"}}}
    return {
        "ChatCompletion": completion("chat.completion", {"message": message}, chat_logprobs),
        "Completion": completion("text_completion", {"text": {"type": "string"}}, completion_logprobs),
        "ChatCompletionChunk": chunk("chat.completion.chunk", {"delta": delta}, chat_logprobs),
        "CompletionChunk": chunk("text_completion", {"text": {"type": "string"}}, completion_logprobs),
        "ModelList": {"type": "object", "required": ["object", "data"],
                      "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": model}}},
        "Health": {"type": "object", "required": ["status"], "properties": {"status": {"enum": ["ok", "unavailable"]}}},
        "Error": error,
    }


_ERRORS = {
    400: "invalid request: malformed JSON, invalid UTF-8, a wrong field type or value, an unknown field",
    401: "missing or invalid API key",
    404: "unknown model, version or replica",
    408: "the request body did not arrive in time",
    409: "the batch cannot be cancelled: it has ended",
    413: "the request body is over the limit",
    429: "rate limit (`error.type` requests or tokens) or the mesh's own capacity; see Retry-After",
    500: "internal error",
    502: "the mesh ended the stream without a final message",
    503: "overloaded or no replica available; see Retry-After",
    504: "the request's deadline passed",
}


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event: a JSON chunk (or an error, if the stream fails midway), then `[DONE]`."""
    payload = {"anyOf": [_ref(chunk), _ref("Error")]}
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "if": {"const": "[DONE]"}, "else": {"contentMediaType": JSON, "contentSchema": payload}}}}


def _errors(*codes: int) -> dict[str, Any]:
    retry = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer", "minimum": 1}}}
    return {str(c): {"description": _ERRORS[c], **({"headers": retry} if c in (429, 503) else {}),
                     "content": {JSON: {"schema": _ref("Error")}}} for c in codes}


def document(config: EdgeConfig) -> dict[str, Any]:
    secured = bool(config.api_key_digests)
    security: dict[str, Any] = {"security": [{"bearerAuth": []}]} if secured else {}
    auth_errors = (401, 429) if secured else (429,)

    def completion(summary: str, request: str, reply: str, chunk: str) -> dict[str, Any]:
        return {
            "summary": summary, **security,
            "parameters": [
                {"name": "x-session-id", "in": "header", "required": False, "schema": {"type": "string"},
                 "description": "names a session (session affinity)"},
                {"name": "x-infermesh-replica", "in": "header", "required": False, "schema": {"type": "string"},
                 "description": "pins a replica (operators, tests)"},
            ],
            "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
            "responses": {
                "200": {"description": "the completion, or with stream: true server-sent events of chunks "
                                       "ending in `data: [DONE]`",
                        "content": {JSON: {"schema": _ref(reply)}, "text/event-stream": {"schema": _event(chunk)}}},
                **_errors(400, *auth_errors, 404, 408, 413, 500, 502, 503, 504),
            },
        }

    def plain(summary: str, request: str, reply: str) -> dict[str, Any]:
        return {"summary": summary, **security,
                "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
                "responses": {"200": {"description": reply, "content": {JSON: {"schema": _ref(reply)}}},
                              **_errors(400, *auth_errors, 404, 408, 413, 500, 502, 503, 504)}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "infermesh edge", "version": "1",
                 "description": "OpenAI-compatible API of an infermesh mesh. Every completion (the last chunk "
                                "when streaming) carries an `infermesh` object naming the replica that served it."},
        "paths": {
            "/health": {"get": {"summary": "200 when every service is ready", "responses": {
                "200": {"description": "ready", "content": {JSON: {"schema": _ref("Health")}}},
                "503": {"description": "not ready", "content": {JSON: {"schema": _ref("Health")}}}}}},
            "/v1/models": {"get": {"summary": "the served models", **security, "responses": {
                "200": {"description": "models", "content": {JSON: {"schema": _ref("ModelList")}}},
                **_errors(*auth_errors, 503, 504)}}},
            "/v1/chat/completions": {"post": completion("chat completion", "ChatCompletionRequest",
                                                        "ChatCompletion", "ChatCompletionChunk")},
            "/v1/completions": {"post": completion("text completion", "CompletionRequest", "Completion",
                                                   "CompletionChunk")},
            "/v1/responses": {"post": {**plain("the Responses API: a response (stream: true gives its typed events)",
                                               "ResponseRequest", "Response"),
                                         "responses": {
                                             "200": {"description": "the response, or server-sent events",
                                                     "content": {JSON: {"schema": _ref("Response")},
                                                                 "text/event-stream": {"schema": {
                                                                     "type": "object", "required": ["data"],
                                                                     "properties": {"data": {"type": "string"}}}}}},
                                             **_errors(400, *auth_errors, 404, 408, 413, 500, 502, 503, 504)}}},
            "/v1/embeddings": {"post": plain("embeddings: each input's pooled final hidden states, normalized",
                                             "EmbeddingRequest", "EmbeddingResponse")},
            "/tokenize": {"post": plain("a prompt or conversation as the model's tokenizer sees it (vLLM's shape)",
                                        "TokenizeRequest", "TokenizeResponse")},
            "/detokenize": {"post": plain("token ids back to text, special tokens kept (vLLM's shape)",
                                          "DetokenizeRequest", "DetokenizeResponse")},
            **openapi_batches.paths(security, auth_errors, _errors),
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": {
                "200": {"description": "OpenAPI 3.1", "content": {JSON: {"schema": {"type": "object"}}}}}}},
        },
        "components": {
            "schemas": {**_request_schemas(config), **_response_schemas(), **openapi_batches.schemas()},
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                               "description": "an API key (INFERMESH_API_KEYS)"}},
        },
    }
