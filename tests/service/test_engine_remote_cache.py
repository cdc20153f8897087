"""Two engines in-process and a real cache service on loopback: engine A computes a prompt and
publishes its blocks; engine B loads them instead of computing them, with the same greedy tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import torch

from mesh.grpcutil import Service, channel
from meshpb.v1 import cache_pb2, cache_pb2_grpc, common_pb2, engine_pb2, engine_pb2_grpc
from services.cache.server import CacheServicer, add_to
from services.cache.sessions import SessionStore
from services.cache.store import BlockStore
from services.engine.config import EngineConfig
from services.engine.core.request import SamplingParams, StepOutput
from services.engine.engine import Engine
from services.engine.rpcs import server as engine_server
from services.engine.rpcs.remote_cache import RemoteCache, kv_version
from services.engine.runtime import kv_transfer
from services.engine.runtime.kv_transfer import Outbox
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide
from tests.service.test_engine import chat_ids, tokens

MODEL = "smollm2-135m"
KV_BYTES = 48 << 20          # 68 blocks of 737,280 bytes (fp32): plenty for one ~250-token prompt


@pytest.fixture(scope="module")
def runners(model_dir: Path) -> tuple[ModelRunner, ModelRunner]:
    plan = decide(device="cpu", dtype="float32")
    return ModelRunner(model_dir, plan, kv_cache_bytes=KV_BYTES), ModelRunner(model_dir, plan, kv_cache_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def prompt(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return chat_ids(AutoTokenizer.from_pretrained(str(model_dir)), "Summarize the plot of Hamlet, act by act. " * 20)


def run(engine: Engine, request_id: str, ids: list[int]) -> list[StepOutput]:
    engine.add(engine.make_request(request_id, ids, SamplingParams(max_tokens=12)))
    return engine.run_until_idle()[request_id]


def remote(address: str, runner: ModelRunner, **kwargs: float) -> RemoteCache:
    layout = kv_transfer.layout(runner.kv)
    return RemoteCache(address, MODEL, kv_version("1", layout, runner.matmul), layout, **kwargs)


def with_cache(scenario: Callable[[str, BlockStore], Awaitable[None]]) -> None:
    async def main() -> None:
        store = BlockStore.create(hot_bytes=256 << 20)
        service = Service("meshpb.v1.Cache", "127.0.0.1", 0)
        add_to(service, CacheServicer(SessionStore(ttl_s=60), store))
        await service.start()
        try:
            await scenario(f"127.0.0.1:{service.port}", store)
        finally:
            await service.stop(0)

    asyncio.run(main())


def test_engine_b_imports_what_engine_a_published_and_generates_the_same(
        runners: tuple[ModelRunner, ModelRunner], prompt: list[int]) -> None:
    runner_a, runner_b = runners
    bs = runner_a.block_size
    usable = (len(prompt) - 1) // bs             # blocks a request with this prompt may load

    async def scenario(address: str, store: BlockStore) -> None:
        # A computes the prompt; its step copies the prompt's full blocks into the outbox.
        outbox_a = Outbox(256 << 20)
        a = Engine(runner_a, outbox=outbox_a)
        cold_a = run(a, "a", prompt)
        assert cold_a[-1].cached_tokens == 0
        cache_a = remote(address, runner_a)
        published = 0
        while (batch := outbox_a.take()) is not None:
            published += await cache_a.publish(batch)
        assert published == outbox_a.put_blocks == len(prompt) // bs
        assert store.stats().hot_blocks == len(prompt) // bs

        # The reference: B recomputes the prompt itself (a fresh engine: nothing cached).
        recomputed = run(Engine(runner_b), "ref", prompt)
        for k, v in runner_b.kv:                 # nothing B computed may help it now
            k.zero_()
            v.zero_()

        outbox_b = Outbox(256 << 20)
        b = Engine(runner_b, outbox=outbox_b)
        cache_b = remote(address, runner_b)
        req = b.make_request("b", prompt, SamplingParams(max_tokens=12))
        start, hashes = b.uncached_prefix(req.all_ids)
        assert (start, len(hashes)) == (0, usable)
        t0 = time.perf_counter()
        req.staged = await cache_b.fetch(start, hashes)
        fetch_s = time.perf_counter() - t0
        assert [s.position for s in req.staged] == list(range(usable))
        assert cache_b.stats.fetched_blocks == usable
        b.add(req)
        first = b.step()
        assert b.stats.last_step_tokens == len(prompt) - usable * bs       # only the tail was computed
        outs = first
        while b.has_work():
            outs.extend(b.step())
        print(f"\n{len(prompt)}-token prompt: fetched {usable} blocks in {fetch_s * 1000:.0f} ms; "
              f"B computed {len(prompt) - usable * bs} tokens instead of {len(prompt)}")

        assert tokens(outs) == tokens(recomputed) == tokens(cold_a)
        assert outs[-1].cached_tokens == usable * bs == b.blocks.imported == b.blocks.hits
        # B publishes only what it computed: a block it imported is never sent back.
        assert outbox_b.put_blocks == len(prompt) // bs - usable
        await cache_a.close()
        await cache_b.close()

    with_cache(scenario)


def test_blocks_of_another_layout_are_never_loaded(runners: tuple[ModelRunner, ModelRunner],
                                                   prompt: list[int]) -> None:
    runner = runners[1]
    b = Engine(runner)

    async def scenario(address: str, store: BlockStore) -> None:
        cache = remote(address, runner)
        _, hashes = b.uncached_prefix(prompt)
        lay = cache.layout
        bad_shape = (lay.shape[0], 2, lay.shape[2], lay.shape[3] * 2, lay.shape[4] // 2)   # same bytes

        async def blocks() -> AsyncIterator[cache_pb2.KVBlock]:
            for i, h in enumerate(hashes[:3]):
                yield cache_pb2.KVBlock(key=cache_pb2.BlockKey(model=MODEL, version=cache.version, hash=h),
                                        data=bytes(lay.block_bytes), dtype="float32",
                                        shape=lay.shape if i < 2 else bad_shape, num_tokens=16)

        async with channel(address) as ch:
            await cache_pb2_grpc.CacheStub(ch).PutBlocks(blocks())
        staged = await cache.fetch(0, hashes)
        assert [s.position for s in staged] == [0, 1]
        assert all(s.kv.shape == lay.shape and s.kv.dtype == torch.float32 for s in staged)
        assert cache.stats.rejected_blocks == 1
        # A different dtype is a different version in the key: an fp32 engine never even sees bf16 blocks.
        bf16 = kv_transfer.KVLayout(torch.bfloat16, lay.shape)
        assert kv_version("1", bf16, "exact") != kv_version("1", lay, "exact")
        await cache.close()

    with_cache(scenario)


def test_a_dead_cache_costs_nothing_but_the_import(runners: tuple[ModelRunner, ModelRunner],
                                                    prompt: list[int]) -> None:
    runner = runners[1]

    async def scenario() -> None:
        cache = remote("127.0.0.1:9", runner, timeout_s=2.0, retry_after_s=60.0)   # nothing listens there
        engine = Engine(runner, outbox=Outbox(64 << 20))
        start, hashes = engine.uncached_prefix(prompt)
        t0 = time.perf_counter()
        assert await cache.fetch(start, hashes) == []
        assert await cache.fetch(start, hashes) == []          # skipped: no second attempt for a while
        assert time.perf_counter() - t0 < 2.0
        assert cache.stats.errors == 1
        outs = run(engine, "r", prompt)
        assert outs[-1].finish_reason is not None and outs[-1].cached_tokens == 0

        # The publisher drops what it cannot send and keeps going; the outbox stays bounded.
        outbox = engine.outbox
        assert outbox is not None and len(outbox) > 0
        wake = asyncio.Event()
        publisher = asyncio.create_task(cache.run_publisher(outbox, wake))
        wake.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not len(outbox):
                break
        publisher.cancel()
        assert cache.stats.dropped_blocks == outbox.put_blocks == len(prompt) // runner.block_size
        await cache.close()

    asyncio.run(scenario())


def test_the_servicers_fetch_before_admission_and_publish_after_prefill(
        runners: tuple[ModelRunner, ModelRunner], prompt: list[int], model_dir: Path) -> None:
    """The gRPC glue: Generate on engine-b loads what engine-a's publisher task sent, unasked."""
    bs = runners[0].block_size

    async def scenario(address: str, store: BlockStore) -> None:
        services, channels, remotes = [], [], []
        for name, runner in zip(("engine-a", "engine-b"), runners, strict=True):
            config = EngineConfig(model_path=str(model_dir), model=MODEL, replica_id=name, cache=address)
            remotes.append(remote(address, runner))
            servicer = engine_server.EngineServicer(Engine(runner, outbox=Outbox(64 << 20)), config, remotes[-1])
            service = Service("meshpb.v1.Engine", "127.0.0.1", 0)
            engine_server.add_to(service, servicer)
            await service.start()
            servicer.start()
            services.append((service, servicer))
            channels.append(channel(f"127.0.0.1:{service.port}"))
        stubs = [engine_pb2_grpc.EngineStub(ch) for ch in channels]
        request = engine_pb2.GenerateRequest(prompt_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=12))
        try:
            a = [m async for m in stubs[0].Generate(request)]
            for _ in range(200):                        # the publisher sends after the step, not before the reply
                if store.stats().hot_blocks == len(prompt) // bs:
                    break
                await asyncio.sleep(0.05)
            assert store.stats().hot_blocks == len(prompt) // bs
            b = [m async for m in stubs[1].Generate(request)]
            assert [t for m in b for t in m.ids] == [t for m in a for t in m.ids]
            assert (a[-1].usage.cached_tokens, b[-1].usage.cached_tokens) == (0, (len(prompt) - 1) // bs * bs)
            assert services[1][1]._staging == {}        # the fetched KV was released at admission
            assert remotes[1].stats.fetched_blocks == (len(prompt) - 1) // bs
        finally:
            for ch in channels:
                await ch.close()
            for service, servicer in services:
                await servicer.close()
                await service.stop(0)

    with_cache(scenario)
