"""End to end with gRPC stubs straight to the router, skipping the edge."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from meshpb.v1 import common_pb2, router_pb2, router_pb2_grpc, tokenizer_pb2
from tests.e2e.conftest import Mesh

pytestmark = pytest.mark.e2e


def test_router_generate_with_grpc_stubs(mesh: Mesh, reference) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Name three colors."}]
    expected = reference(20, messages=messages)

    async def scenario() -> list[router_pb2.RouterGenerateResponse]:
        async with mesh.channel(mesh.router) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            request = router_pb2.RouterGenerateRequest(
                model="smollm2-135m", include_token_ids=True,
                chat=router_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(**m) for m in messages]),
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=20))
            replies = [r async for r in stub.Generate(request, timeout=120)]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(router_pb2.RouterGenerateRequest(model="smollm2-135m"), timeout=30):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            return replies

    replies = asyncio.run(scenario())
    assert "".join(r.text for r in replies) == expected
    final = replies[-1]
    assert final.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert final.usage.completion_tokens == sum(len(r.ids) for r in replies)
    assert final.served_by.replica in ("engine-0", "engine-1") and final.served_by.confidence == 1.0


def test_engine_refuses_a_duplicate_request_id(mesh: Mesh) -> None:
    from meshpb.v1 import engine_pb2, engine_pb2_grpc

    engine = f"127.0.0.1:{int(mesh.router.rsplit(':', 1)[1]) + 9}"   # engine-0: router port + 9
    request = engine_pb2.GenerateRequest(request_id="dup-1", prompt_ids=[1, 2, 3, 4],
                                         sampling=common_pb2.SamplingParams(max_tokens=40, ignore_eos=True))

    async def scenario() -> grpc.StatusCode:
        async with mesh.channel(engine) as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            first = stub.Generate(request, timeout=120)
            await first.read()                      # the first request is running
            try:
                async for _ in stub.Generate(request, timeout=30):
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code()
            finally:
                first.cancel()
            return grpc.StatusCode.OK

    assert asyncio.run(scenario()) == grpc.StatusCode.INVALID_ARGUMENT


def test_the_mesh_refuses_callers_without_its_certificate(mesh: Mesh) -> None:
    # `infermesh up` runs mutual TLS: a plaintext caller (any local process) reaches no service.
    async def scenario() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(mesh.router) as ch:
            try:
                await router_pb2_grpc.RouterStub(ch).ListReplicas(router_pb2.ListReplicasRequest(), timeout=10)
            except grpc.aio.AioRpcError as err:
                return err.code()
            return grpc.StatusCode.OK

    assert asyncio.run(scenario()) == grpc.StatusCode.UNAVAILABLE


def test_list_replicas_carries_each_engines_load_report(mesh: Mesh) -> None:
    async def scenario() -> router_pb2.ListReplicasResponse:
        async with mesh.channel(mesh.router) as ch:
            return await router_pb2_grpc.RouterStub(ch).ListReplicas(router_pb2.ListReplicasRequest(), timeout=10)

    reply = asyncio.run(scenario())
    assert [r.replica_id for r in reply.replicas] == ["engine-0", "engine-1"]
    for r in reply.replicas:
        assert r.healthy and r.model == "smollm2-135m"
        assert r.load.kv_blocks_total > 0 and 0 < r.load.kv_blocks_free <= r.load.kv_blocks_total
        assert r.load.unix_ms > 0


def test_router_tokenize_and_detokenize_with_grpc_stubs(mesh: Mesh, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [tokenizer_pb2.ChatMessage(role="user", content="Name three colors.")]

    async def scenario() -> tuple[router_pb2.TokenizeResponse, str, list[grpc.StatusCode]]:
        async with mesh.channel(mesh.router) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            tokens = await stub.Tokenize(router_pb2.TokenizeRequest(
                chat=router_pb2.ChatInput(messages=messages), add_generation_prompt=True), timeout=30)
            text = (await stub.Detokenize(router_pb2.DetokenizeRequest(ids=tokens.ids), timeout=30)).text
            codes = []
            chat = router_pb2.ChatInput(messages=messages)
            for bad in (router_pb2.TokenizeRequest(prompt="x", model="no-such-model"),
                        router_pb2.TokenizeRequest(chat=chat, add_special_tokens=True),
                        router_pb2.TokenizeRequest()):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Tokenize(bad, timeout=30)
                codes.append(err.value.code())
            return tokens, text, codes

    tokens, text, codes = asyncio.run(scenario())
    rendered = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors."}], tokenize=False,
                                                add_generation_prompt=True)
    assert list(tokens.ids) == hf_tokenizer.encode(rendered, add_special_tokens=False) and text == rendered
    assert tokens.model == "smollm2-135m" and tokens.max_context > 0 and not tokens.token_strs
    assert codes == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT]
