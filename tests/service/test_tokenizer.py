"""The tokenizer service in-process over real gRPC: chat template, encode, streaming decode."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from mesh.chat import Message
from mesh.detokenize import IncrementalDecoder
from mesh.errors import InvalidArgument
from mesh.grpcutil import Service, channel
from meshpb.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.server import TokenizerServicer, add_to
from services.tokenizer.tokenizer import ModelTokenizer

NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(NAME, model_dir)


def test_chat_template_is_chatml_with_default_system(tok: ModelTokenizer) -> None:
    text = tok.render_chat([Message("user", "Hi there")])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    own = tok.render_chat([Message("system", "Be brief."), Message("user", "Hi")], add_generation_prompt=False)
    assert own == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_unknown_role_is_refused(tok: ModelTokenizer) -> None:
    with pytest.raises(InvalidArgument, match="role 'robot'"):
        tok.render_chat([Message("robot", "x")])


@pytest.mark.parametrize("text", ["Hello, world!", "日本語とemoji 🚀🔥, accents: àéîõü", "tabs\tand\nnewlines  "])
def test_streaming_decode_matches_full_decode(tok: ModelTokenizer, text: str) -> None:
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok.decode)
    pieces = [decoder.push([i], final=n == len(ids) - 1) for n, i in enumerate(ids)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text


def test_service_over_grpc(tok: ModelTokenizer) -> None:
    async def scenario() -> None:
        service = Service("meshpb.v1.Tokenizer", "127.0.0.1", 0)
        add_to(service, TokenizerServicer({NAME: tok}, default=NAME))
        await service.start()
        try:
            async with channel(f"127.0.0.1:{service.port}") as ch:
                stub = tokenizer_pb2_grpc.TokenizerStub(ch)
                enc = await stub.ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(
                    model="default", messages=[tokenizer_pb2.ChatMessage(role="user", content="Hi")],
                    add_generation_prompt=True))
                assert list(enc.ids) == tok.encode(enc.text)
                batch = await stub.EncodeBatch(tokenizer_pb2.EncodeBatchRequest(model=NAME, texts=["a b", "c"]))
                assert [list(i.ids) for i in batch.items] == [tok.encode("a b"), tok.encode("c")]
                ids = tok.encode("🚀 go")
                step = await stub.DecodeIncremental(tokenizer_pb2.DecodeIncrementalRequest(
                    model=NAME, ids=ids[:1], read_offset=0, skip_special_tokens=True))
                assert "\ufffd" not in step.text
                info = await stub.GetModelInfo(tokenizer_pb2.ModelInfoRequest(model=NAME))
                assert 2 in info.eos_token_ids and info.has_chat_template
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Encode(tokenizer_pb2.EncodeRequest(model="nope", text="x"))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                assert "available: smollm2-135m" in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ApplyChatTemplate(tokenizer_pb2.ChatTemplateRequest(
                        model=NAME, messages=[tokenizer_pb2.ChatMessage(role="robot", content="x")]))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await service.stop(0)

    asyncio.run(scenario())
