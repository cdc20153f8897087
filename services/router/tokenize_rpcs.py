"""The router's Tokenize and Detokenize RPCs (the edge's POST /tokenize and /detokenize): a prompt or a
conversation as the model's tokenizer sees it (the ids Generate would give the model; nothing is generated),
and token ids back to text with the special tokens kept, so a templated prompt reads back as it was rendered.

A mixin of RouterServicer (services/router/server.py), which holds the callers, the tokenizer client and
the admin view these use."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import grpc

from mesh.clients.values import Tokens
from mesh.errors import InvalidArgument
from mesh.grpcutil import rpc_errors
from services.router import wire

if TYPE_CHECKING:
    from services.router.admin import Admin
    from services.router.callers import Callers
    from services.router.upstream import Tokenizer


class TokenRPCs:
    callers: Callers
    tokenizer: Tokenizer
    admin: Admin

    @rpc_errors
    async def Tokenize(self, request: wire.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> wire.TokenizeResponse:
        self.callers.check_user(context, "Tokenize")
        spec = wire.tokenization(request)
        model = self.admin.resolve(spec.model)
        if spec.chat is None and spec.prompt is None:
            raise InvalidArgument("give a prompt or chat messages to tokenize")
        if spec.chat is not None and spec.add_special_tokens:
            raise InvalidArgument("add_special_tokens is for a prompt: a chat template places the model's special "
                                  "tokens itself")
        ids = await self.tokenizer.encode(spec, model)
        tokens = Tokens(model, tuple(ids), self.admin.max_context(model))
        if spec.return_token_strs:
            vocabulary = await self.tokenizer.vocabulary(model)
            tokens = dataclasses.replace(tokens, token_strs=tuple(vocabulary.id_to_token(i) or "" for i in ids))
        return wire.tokens_pb(tokens)

    @rpc_errors
    async def Detokenize(self, request: wire.DetokenizeRequest, context: grpc.aio.ServicerContext
                         ) -> wire.DetokenizeResponse:
        self.callers.check_user(context, "Detokenize")
        model = self.admin.resolve(request.model)
        vocabulary = await self.tokenizer.vocabulary(model)
        size = vocabulary.get_vocab_size(with_added_tokens=True)
        outside = next((i for i in request.ids if i >= size), None)
        if outside is not None:
            raise InvalidArgument(f"token id {outside} is outside the vocabulary of {model} (ids 0-{size - 1})")
        return wire.detokenized(vocabulary.decode(list(request.ids), skip_special_tokens=False))
