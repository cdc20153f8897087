"""POST /tokenize and POST /detokenize, in vLLM's shapes: a prompt or a conversation as the model's tokenizer
sees it (the ids a completion request with it would be given), and token ids back to text.

Through a router (its Tokenize / Detokenize RPCs) to the tokenizer service; nothing is generated, so no
token rate is charged.  The caller's key, signature and request rate are checked as on every API route
(services/edge/app.py).  Pure parsing here, every rejection an ApiError(400) naming the field; the schemas
that services/edge/surfaces/openapi.py publishes for the two routes are here too, beside the rules they state.
"""

from __future__ import annotations

from typing import Any

import grpc

from mesh.clients.router_client import TokenizeSpec
from mesh.clients.router_pool import Routers
from services.edge.config import EdgeConfig
from services.edge.errors import ApiError, from_grpc
from services.edge.gateway.pipeline import Pipeline
from services.edge.surfaces import structured
from services.edge.surfaces.fields import MAX_NAME_CHARS, MAX_TOKEN_ID, boolean, is_token_id, no_unknown, string
from services.edge.surfaces.requests import MAX_MESSAGES, parse_messages
from services.edge.transports.asgi import Receive, Scope, Send, send_json

TOKENIZE_FIELDS = {"model", "prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs"}
CHAT_ONLY = ("add_generation_prompt", "tools")
MAX_IDS = 1 << 17              # token ids in one /detokenize (the 1 MiB body holds ~150k short ones)


def parse_tokenize(body: dict[str, Any], max_messages: int = MAX_MESSAGES) -> TokenizeSpec:
    """A /tokenize body: exactly one of `prompt` (text) and `messages` (a conversation, with `tools`)."""
    no_unknown(body, TOKENIZE_FIELDS)
    model = string(body, "model")
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise ApiError(400, "give exactly one of 'prompt' (text) and 'messages' (a conversation)",
                       "messages" if has_messages else "prompt")
    token_strs = boolean(body, "return_token_strs")
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise ApiError(400, f"'prompt' must be a string, got {type(body['prompt']).__name__}", "prompt",
                           code="invalid_type")
        for name in CHAT_ONLY:
            if body.get(name) is not None:
                raise ApiError(400, f"'{name}' is for 'messages', not 'prompt'", name)
        return TokenizeSpec(model, prompt=body["prompt"], add_special_tokens=boolean(body, "add_special_tokens", True),
                            return_token_strs=token_strs)
    messages = parse_messages(body["messages"], max_messages)
    if boolean(body, "add_special_tokens"):
        raise ApiError(400, "'add_special_tokens' is for 'prompt': a chat template places the model's special tokens "
                       "itself", "add_special_tokens")
    return TokenizeSpec(model, messages=messages, tools=structured.tools_json(body.get("tools")),
                        add_generation_prompt=boolean(body, "add_generation_prompt", True),
                        return_token_strs=token_strs)


def parse_detokenize(body: dict[str, Any]) -> tuple[str, list[int]]:
    """A /detokenize body: (model, token ids)."""
    no_unknown(body, {"model", "tokens"})
    model = string(body, "model")
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise ApiError(400, "'tokens' must be a list of token ids", "tokens",
                       code="missing_required_parameter" if ids is None else "invalid_type")
    if len(ids) > MAX_IDS:
        raise ApiError(400, f"'tokens' holds at most {MAX_IDS} ids, got {len(ids)}", "tokens")
    for i, t in enumerate(ids):
        if not is_token_id(t):
            raise ApiError(400, f"'tokens[{i}]' must be a token id (an integer from 0), got {str(t)[:40]}",
                           f"tokens[{i}]")
    return model, ids


class Tokenizing:
    """The two routes' handlers (app.py routes them; the caller is admitted by then)."""

    def __init__(self, config: EdgeConfig, router: Routers, pipe: Pipeline):
        self.config, self.router, self.pipe = config, router, pipe

    async def tokenize(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        body = await self.pipe.read_json(scope, receive, headers)
        spec = parse_tokenize(body, self.config.max_messages)
        await self.pipe.screen(body, scope["infermesh.caller"])     # once parsed: the rules read checked fields
        try:
            tokens = await self.router.tokenize(spec)
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        await send_json(send, 200, {"model": tokens.model, "count": len(tokens.ids),
                                    "max_model_len": tokens.max_context, "tokens": list(tokens.ids),
                                    "token_strs": list(tokens.token_strs) if tokens.token_strs is not None else None})
        return 200

    async def detokenize(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        model, ids = parse_detokenize(await self.pipe.read_json(scope, receive, headers))
        try:
            text = await self.router.detokenize(model, ids)
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        await send_json(send, 200, {"model": model, "prompt": text})
        return 200


def schemas(max_messages: int, tools: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI schemas of the two routes' bodies and answers (services/edge/surfaces/openapi.py); `tools`: the chat
    completions' schema of that field."""
    flag = {"type": ["boolean", "null"]}
    null = {"type": "null"}
    model = {"type": ["string", "null"], "maxLength": MAX_NAME_CHARS,
             "description": "a served model; '' or absent: the default"}
    chat = {"type": "object", "additionalProperties": False, "required": ["messages"], "properties": {
        "model": model, "messages": {"type": "array", "minItems": 1, "maxItems": max_messages,
                                     "items": {"$ref": "#/components/schemas/ChatMessage"}},
        "tools": tools, "prompt": null,
        "add_generation_prompt": {**flag, "description": "end with the assistant's turn opening (default true)"},
        "add_special_tokens": {"enum": [False, None], "description": "false: the template places special tokens"},
        "return_token_strs": flag}}
    prompt = {"type": "object", "additionalProperties": False, "required": ["prompt"], "properties": {
        "model": model, "prompt": {"type": "string"}, "messages": null, "tools": null, "add_generation_prompt": null,
        "add_special_tokens": {**flag, "description": "the tokenizer's own, e.g. BOS (default true)"},
        "return_token_strs": flag}}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    return {
        "TokenizeRequest": {"oneOf": [prompt, chat]},
        "TokenizeResponse": {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"],
                             "properties": {"model": {"type": "string"}, "count": {"type": "integer", "minimum": 0},
                                            "max_model_len": {"type": "integer", "minimum": 0}, "tokens": ids,
                                            "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}},
        "DetokenizeRequest": {"type": "object", "additionalProperties": False, "required": ["tokens"],
                              "properties": {"model": model, "tokens": {
                                  "type": "array", "maxItems": MAX_IDS,
                                  "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}}},
        "DetokenizeResponse": {"type": "object", "required": ["prompt"],
                               "properties": {"model": {"type": "string"}, "prompt": {"type": "string"}}},
    }
