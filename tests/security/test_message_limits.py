"""Issue 16: every service took 64 MiB messages (the KV-block size) from anyone, so a 20 MB prompt
reached the router and tokenizer whole.  Now a server takes the largest valid request
(mesh.grpcutil.REQUEST_MESSAGE_BYTES, the tokenizer's input limit); only the cache, which receives KV
blocks, keeps 64 MiB.  On a7f9686 the 20 MB Generate below was accepted."""

from __future__ import annotations

import asyncio

import grpc

from mesh.grpcutil import MAX_MESSAGE_BYTES, REQUEST_MESSAGE_BYTES, Service, channel
from meshpb.v1 import router_pb2, router_pb2_grpc
from tests.security.test_mtls import serving
from tests.security.test_peers import _Recorder, bare_router


def generate_with(prompt_bytes: int) -> str:
    recorder = _Recorder()
    servicer = bare_router(recorder)

    async def run() -> str:
        def register(service: Service) -> None:
            router_pb2_grpc.add_RouterServicer_to_server(servicer, service.server)

        async with serving(None, "meshpb.v1.Router", register) as address:
            async with channel(address) as ch:
                request = router_pb2.RouterGenerateRequest(prompt="a" * prompt_bytes)
                try:
                    async for _ in router_pb2_grpc.RouterStub(ch).Generate(request, timeout=10):
                        pass
                except grpc.aio.AioRpcError as err:
                    return err.code().name
                return "OK"

    return asyncio.run(run())


def test_a_20mb_request_is_refused_before_parsing() -> None:
    assert generate_with(20 << 20) == "RESOURCE_EXHAUSTED"


def test_the_largest_valid_prompt_fits() -> None:
    assert generate_with(1 << 20) == "OK"          # more than the tokenizer's 768 KiB input limit


def test_only_the_cache_takes_kv_sized_messages() -> None:
    assert REQUEST_MESSAGE_BYTES < MAX_MESSAGE_BYTES

    async def made() -> int:
        return Service("x", "127.0.0.1", 0).max_receive_bytes

    assert asyncio.run(made()) == REQUEST_MESSAGE_BYTES
