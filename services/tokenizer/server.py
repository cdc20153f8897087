"""Tokenizer gRPC servicer: protobuf in, protobuf out; the work is in tokenizer.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc

from mesh import peers, tools
from mesh.chat import from_pb
from mesh.errors import InvalidArgument, NotFound
from mesh.grpcutil import Service, rpc_errors
from mesh.reasoning import reasoning_format
from mesh.request_limits import template_kwargs_problem
from mesh.telemetry import server_span
from meshpb.v1 import tokenizer_pb2 as pb
from meshpb.v1 import tokenizer_pb2_grpc as pb_grpc
from services.tokenizer import metrics
from services.tokenizer.limits import InputLimits
from services.tokenizer.tokenizer import ModelTokenizer


class TokenizerServicer(pb_grpc.TokenizerServicer):
    """Encoding runs in worker threads (`asyncio.to_thread`): a long prompt must not hold up the
    event loop, and with it every other request's RPC.  Inputs are sized against `limits` first:
    what is refused is never tokenized."""

    def __init__(self, tokenizers: dict[str, ModelTokenizer], default: str,
                 limits: InputLimits | None = None):
        self.tokenizers = tokenizers
        self.default = default
        self.limits = limits or InputLimits()

    def _get(self, model: str) -> ModelTokenizer:
        name = model or self.default
        if name == "default":
            name = self.default
        tok = self.tokenizers.get(name)
        if tok is None:
            raise NotFound(f"model {name!r} is not served here; available: {', '.join(self.tokenizers)}")
        return tok

    @rpc_errors
    async def ApplyChatTemplate(self, request: pb.ChatTemplateRequest, context: grpc.aio.ServicerContext
                                ) -> pb.EncodeResponse:
        peers.require(context, "ApplyChatTemplate", peers.TOKENIZER)
        with server_span("tokenizer.apply_chat_template", context, messages=len(request.messages)):
            tok = self._get(request.model)
            messages = [from_pb(m) for m in request.messages]
            self.limits.check_messages(messages, request.tools)
            tools.check(request.tools, messages)
            ids, text = await asyncio.to_thread(tok.chat, messages, request.add_generation_prompt,
                                                request.parse_special_tokens, request.tools,
                                                template_variables(request.template_kwargs))
            metrics.TOKENS.labels("chat_template").inc(len(ids))
            return pb.EncodeResponse(ids=ids, text=text, reasoning=reasoning_format(tok.think_tags, text))

    @rpc_errors
    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        peers.require(context, "Encode", peers.TOKENIZER)
        with server_span("tokenizer.encode", context):
            tok = self._get(request.model)
            self.limits.check_text(request.text)
            ids = await asyncio.to_thread(tok.encode, request.text, request.add_special_tokens,
                                          request.parse_special_tokens)
            metrics.TOKENS.labels("encode").inc(len(ids))
            return pb.EncodeResponse(ids=ids, text=request.text)

    @rpc_errors
    async def GetTokenizerJson(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
                               ) -> pb.TokenizerJson:
        peers.require(context, "GetTokenizerJson", peers.TOKENIZER)
        with server_span("tokenizer.get_tokenizer_json", context, model=request.model):
            tok = self._get(request.model)
            return pb.TokenizerJson(model=tok.name, tokenizer_json=tok.json())


def add_to(service: Service, servicer: TokenizerServicer) -> None:
    pb_grpc.add_TokenizerServicer_to_server(servicer, service.server)


def template_variables(text: str) -> dict[str, Any]:
    """A request's template variables (ChatTemplateRequest.template_kwargs, JSON), checked."""
    if not text:
        return {}
    try:
        variables = json.loads(text)
    except ValueError:
        raise InvalidArgument("template_kwargs is not JSON") from None
    problem = template_kwargs_problem(variables)
    if problem:
        raise InvalidArgument(problem)
    return dict(variables)
