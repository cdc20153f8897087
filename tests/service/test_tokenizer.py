"""The tokenizer service in-process over real gRPC: chat template, encode, and the tokenizer JSON from
which the router decodes streams."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from tokenizers import Tokenizer

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


def json_decoder(tokenizer_json: str) -> Callable[[Sequence[int]], str]:
    """ids -> text as the router builds it from GetTokenizerJson."""
    decoder = Tokenizer.from_str(tokenizer_json)
    return lambda ids: str(decoder.decode(list(ids), skip_special_tokens=True))


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
def test_streaming_decode_from_the_json_matches_full_decode(tok: ModelTokenizer, hf_tokenizer: Any, text: str) -> None:
    ids = tok.encode(text)
    decode = json_decoder(tok.json())
    decoder = IncrementalDecoder(decode)
    pieces = [decoder.push([i], final=n == len(ids) - 1) for n, i in enumerate(ids)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text


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
                # the template's markers are control tokens: the ids are the text's with controls parsed
                assert list(enc.ids) == tok.encode(enc.text, parse_special=True)
                enc = await stub.Encode(tokenizer_pb2.EncodeRequest(model=NAME, text="a b", add_special_tokens=True))
                assert list(enc.ids) == tok.encode("a b", True) and enc.text == "a b"
                spec = await stub.GetTokenizerJson(tokenizer_pb2.ModelInfoRequest(model="default"))
                assert spec.model == NAME
                ids = tok.encode("🚀 go")
                assert json_decoder(spec.tokenizer_json)(ids) == "🚀 go"
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
