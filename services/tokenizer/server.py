"""Tokenizer gRPC servicer: protobuf in, protobuf out; the work is in tokenizer.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from mesh.chat import Message
from mesh.detokenize import decode_step
from mesh.errors import InvalidArgument, NotFound
from mesh.grpcutil import Service, rpc_errors
from mesh.telemetry import server_span
from meshpb.v1 import tokenizer_pb2 as pb
from meshpb.v1 import tokenizer_pb2_grpc as pb_grpc
from services.tokenizer import metrics
from services.tokenizer.tokenizer import ModelTokenizer

# An interactive request must not wait behind a large batch encode on the event loop;
# tokenizer calls are fast, so they run in a small thread pool.
_POOL_WORKERS = 2


class TokenizerServicer(pb_grpc.TokenizerServicer):
    def __init__(self, tokenizers: dict[str, ModelTokenizer], default: str):
        self.tokenizers = tokenizers
        self.default = default

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
        with server_span("tokenizer.apply_chat_template", context, messages=len(request.messages)):
            tok = self._get(request.model)
            messages = [Message(m.role, m.content, m.name) for m in request.messages]
            text = tok.render_chat(messages, add_generation_prompt=request.add_generation_prompt)
            ids = await asyncio.to_thread(tok.encode, text, False)
            metrics.TOKENS.labels("chat_template").inc(len(ids))
            return pb.EncodeResponse(ids=ids, text=text)

    @rpc_errors
    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        with server_span("tokenizer.encode", context):
            tok = self._get(request.model)
            ids = await asyncio.to_thread(tok.encode, request.text, request.add_special_tokens)
            metrics.TOKENS.labels("encode").inc(len(ids))
            return pb.EncodeResponse(ids=ids, text=request.text)

    @rpc_errors
    async def EncodeBatch(self, request: pb.EncodeBatchRequest, context: grpc.aio.ServicerContext
                          ) -> pb.EncodeBatchResponse:
        with server_span("tokenizer.encode_batch", context, texts=len(request.texts)):
            tok = self._get(request.model)
            batch = await asyncio.to_thread(tok.encode_batch, list(request.texts), request.add_special_tokens)
            metrics.TOKENS.labels("encode_batch").inc(sum(len(ids) for ids in batch))
            return pb.EncodeBatchResponse(
                items=[pb.EncodeResponse(ids=ids, text=t) for ids, t in zip(batch, request.texts, strict=True)]
            )

    @rpc_errors
    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> pb.DecodeResponse:
        tok = self._get(request.model)
        return pb.DecodeResponse(text=tok.decode(request.ids, request.skip_special_tokens))

    @rpc_errors
    async def DecodeIncremental(self, request: pb.DecodeIncrementalRequest, context: grpc.aio.ServicerContext
                                ) -> pb.DecodeIncrementalResponse:
        tok = self._get(request.model)
        ids = list(request.ids)
        if request.read_offset > len(ids):
            raise InvalidArgument(f"read_offset {request.read_offset} is past the {len(ids)} ids sent")

        def decode(window: Sequence[int]) -> str:
            return tok.decode(window, request.skip_special_tokens)

        step = decode_step(decode, ids, 0, request.read_offset, request.final)
        return pb.DecodeIncrementalResponse(
            text=step.text, prefix_offset=step.prefix_offset, read_offset=step.read_offset
        )

    @rpc_errors
    async def GetModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        tok = self._get(request.model)
        return pb.ModelInfo(
            model=tok.name,
            vocab_size=len(tok.hf),
            eos_token_ids=tok.eos_token_ids,
            bos_token_id=tok.hf.bos_token_id or 0,
            max_context=tok.max_context,
            has_chat_template=bool(tok.hf.chat_template),
        )


    @rpc_errors
    async def GetTokenizerJson(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
                               ) -> pb.TokenizerJson:
        with server_span("tokenizer.get_tokenizer_json", context, model=request.model):
            tok = self._get(request.model)
            return pb.TokenizerJson(model=tok.name, tokenizer_json=tok.hf.backend_tokenizer.to_str())


def add_to(service: Service, servicer: TokenizerServicer) -> None:
    pb_grpc.add_TokenizerServicer_to_server(servicer, service.server)
