"""The router's Tokenize and Detokenize RPCs (the edge's POST /tokenize and /detokenize): a prompt or a
conversation as the model's tokenizer sees it (the ids Generate would give the model; nothing is generated),
and token ids back to text with the special tokens kept, so a templated prompt reads back as it was rendered.

A mixin of RouterServicer (services/router/server.py), which holds the callers, the tokenizer client and
the admin view these use."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from mesh.errors import InvalidArgument
from mesh.grpcutil import rpc_errors
from meshpb.v1 import router_pb2

if TYPE_CHECKING:
    from services.router.admin import Admin
    from services.router.callers import Callers
    from services.router.upstream import Tokenizer


class TokenRPCs:
    callers: Callers
    tokenizer: Tokenizer
    admin: Admin

    @rpc_errors
    async def Tokenize(self, request: router_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> router_pb2.TokenizeResponse:
        self.callers.check_user(context, "Tokenize")
        model = self.admin.resolve(request.model)
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidArgument("give a prompt or chat messages to tokenize")
        if kind == "chat" and request.add_special_tokens:
            raise InvalidArgument("add_special_tokens is for a prompt: a chat template places the model's special "
                                  "tokens itself")
        ids = await self.tokenizer.encode(request, model)
        reply = router_pb2.TokenizeResponse(ids=ids, model=model, max_context=self.admin.max_context(model))
        if request.return_token_strs:
            vocabulary = await self.tokenizer.vocabulary(model)
            reply.token_strs.extend(vocabulary.id_to_token(i) or "" for i in ids)
        return reply

    @rpc_errors
    async def Detokenize(self, request: router_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
                         ) -> router_pb2.DetokenizeResponse:
        self.callers.check_user(context, "Detokenize")
        model = self.admin.resolve(request.model)
        vocabulary = await self.tokenizer.vocabulary(model)
        size = vocabulary.get_vocab_size(with_added_tokens=True)
        outside = next((i for i in request.ids if i >= size), None)
        if outside is not None:
            raise InvalidArgument(f"token id {outside} is outside the vocabulary of {model} (ids 0-{size - 1})")
        return router_pb2.DetokenizeResponse(text=vocabulary.decode(list(request.ids), skip_special_tokens=False))
