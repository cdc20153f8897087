"""KV block RPCs over real gRPC on loopback: a 1,500-token prefix of SmolLM2-135M fp32 blocks
(94 blocks of 737,280 bytes) goes in with one PutBlocks stream and comes back byte-identical."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from mesh.grpcutil import Service, channel
from mesh.prefix import block_hashes
from meshpb.v1 import cache_pb2, cache_pb2_grpc
from services.cache.block_metrics import watch
from services.cache.block_rpcs import BlockRPCs
from services.cache.store import BlockStore

MODEL, VERSION = "SmolLM2-135M-Instruct", "1"
SHAPE = (30, 2, 16, 3, 64)                  # (layers, K/V, block_size, kv_heads, head_dim)
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4      # float32: 737,280
PROMPT_TOKENS = 1504                        # 94 full blocks


class BlockServicer(BlockRPCs, cache_pb2_grpc.CacheServicer):
    def __init__(self, blocks: BlockStore):
        self.blocks = blocks


def prefix_blocks(seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(seed)
    tokens = [rng.randrange(49152) for _ in range(PROMPT_TOKENS)]
    hashes = block_hashes(tokens, 16)
    return hashes, [rng.randbytes(BLOCK_BYTES) for _ in hashes]


def kv_block(h: bytes, data: bytes, dtype: str = "float32", shape: tuple[int, ...] = SHAPE) -> cache_pb2.KVBlock:
    return cache_pb2.KVBlock(key=cache_pb2.BlockKey(model=MODEL, version=VERSION, hash=h), data=data, dtype=dtype,
                             shape=shape, num_tokens=16, tenant="standard")


async def stream(messages: list[cache_pb2.KVBlock]) -> AsyncIterator[cache_pb2.KVBlock]:
    for m in messages:
        yield m


def serve(store: BlockStore, scenario: Callable[[cache_pb2_grpc.CacheStub], Awaitable[None]]) -> None:
    async def main() -> None:
        service = Service("meshpb.v1.Cache", "127.0.0.1", 0)
        cache_pb2_grpc.add_CacheServicer_to_server(BlockServicer(store), service.server)
        await service.start()
        try:
            async with channel(f"127.0.0.1:{service.port}") as ch:
                await scenario(cache_pb2_grpc.CacheStub(ch))
        finally:
            await service.stop(0)

    asyncio.run(main())


async def round_trip(stub: cache_pb2_grpc.CacheStub, hashes: list[bytes], blocks: list[bytes], label: str,
                     store: BlockStore) -> None:
    await stub.GetStats(cache_pb2.CacheStatsRequest())     # connect first, as an engine's long-lived channel has
    t0 = time.perf_counter()
    put = await stub.PutBlocks(stream([kv_block(h, d) for h, d in zip(hashes, blocks, strict=True)]))
    t_put = time.perf_counter() - t0
    assert (put.stored, put.added, put.bytes) == (94, 94, 94 * BLOCK_BYTES)
    t0 = time.perf_counter()
    await store.flush()                     # demotions are written behind PutBlocks; wait for them here
    t_flush = time.perf_counter() - t0

    t0 = time.perf_counter()
    matched = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model=MODEL, version=VERSION,
                                                                  hashes=[*hashes, bytes(16)]))
    t_match = time.perf_counter() - t0
    assert matched.matched == 94

    keys = [cache_pb2.BlockKey(model=MODEL, version=VERSION, hash=h) for h in hashes[:matched.matched]]
    t0 = time.perf_counter()
    got = [m async for m in stub.GetBlocks(cache_pb2.GetBlocksRequest(keys=keys))]
    t_get = time.perf_counter() - t0
    assert [m.key.hash for m in got] == hashes
    assert all(m.data == d for m, d in zip(got, blocks, strict=True))
    assert all(m.dtype == "float32" and tuple(m.shape) == SHAPE and m.num_tokens == 16 for m in got)
    mb = 94 * BLOCK_BYTES / 1e6
    print(f"\n{label}: 94 blocks, {mb:.1f} MB: PutBlocks {t_put * 1000:.0f} ms ({mb / t_put:.0f} MB/s), "
          f"then cold writes {t_flush * 1000:.0f} ms, MatchPrefix {t_match * 1000:.1f} ms, "
          f"GetBlocks {t_get * 1000:.0f} ms ({mb / t_get:.0f} MB/s)")


def test_a_prefix_round_trip_in_ram() -> None:
    store = BlockStore.create(hot_bytes=256 << 20)
    hashes, blocks = prefix_blocks()
    registry = CollectorRegistry()
    watch(store, "cache-test", registry)

    async def scenario(stub: cache_pb2_grpc.CacheStub) -> None:
        await round_trip(stub, hashes, blocks, "hot tier", store)
        # Missing blocks end the stream early: an engine can only use a prefix.
        keys = [cache_pb2.BlockKey(model=MODEL, version=VERSION, hash=h) for h in (hashes[0], bytes(16), hashes[1])]
        got = [m async for m in stub.GetBlocks(cache_pb2.GetBlocksRequest(keys=keys))]
        assert [m.key.hash for m in got] == [hashes[0]]
        again = await stub.PutBlocks(stream([kv_block(hashes[0], blocks[0])]))
        assert (again.stored, again.added) == (1, 0)

        stats = await stub.GetStats(cache_pb2.CacheStatsRequest())
        assert (stats.hot_blocks, stats.hot_bytes, stats.hot_budget_bytes) == (94, 94 * BLOCK_BYTES, 256 << 20)
        assert (stats.hits, stats.misses, stats.hot_hits, stats.hot_misses) == (95, 1, 95, 1)
        assert (stats.bytes_in, stats.bytes_out) == (95 * BLOCK_BYTES, 95 * BLOCK_BYTES)
        assert (stats.match_queried, stats.match_matched, stats.evictions) == (95, 94, 0)
        assert (stats.cold_blocks, stats.cold_budget_bytes) == (0, 0)

        def metric(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {"replica": "cache-test", **labels})

        assert metric("infermesh_cache_block_hits_total", tier="hot") == 95
        assert metric("infermesh_cache_block_misses_total", tier="hot") == 1
        assert metric("infermesh_cache_block_bytes_total", direction="out") == 95 * BLOCK_BYTES
        assert metric("infermesh_cache_block_tier_bytes", tier="hot") == 94 * BLOCK_BYTES
        assert metric("infermesh_cache_block_tier_blocks", tier="hot") == 94
        assert metric("infermesh_cache_block_prefix_matched_total") == 94

    serve(store, scenario)


def test_a_prefix_round_trip_through_the_disk_tier(tmp_path: Path) -> None:
    """RAM holds 10 blocks: 84 are demoted (fsynced files) on the way in and promoted on the way out."""
    store = BlockStore.create(hot_bytes=10 * BLOCK_BYTES, cold_dir=tmp_path, cold_bytes=256 << 20)
    hashes, blocks = prefix_blocks(seed=1)

    async def scenario(stub: cache_pb2_grpc.CacheStub) -> None:
        await round_trip(stub, hashes, blocks, "cold tier", store)
        await store.flush()
        stats = await stub.GetStats(cache_pb2.CacheStatsRequest())
        assert stats.hot_blocks == 10 and stats.cold_blocks == 94 and stats.hot_bytes == 10 * BLOCK_BYTES
        # 84 came from disk.  Read in order, each promotion pushes out one of the last 10 before it is
        # read; those are served from disk, or from memory while their demotion is still being written.
        assert stats.hits == 94 and stats.misses == stats.corrupt == 0
        assert stats.cold_hits >= 84 and stats.cold_hits + stats.hot_hits == 94 == stats.match_matched
        assert stats.promotions == stats.cold_hits and stats.demotions == stats.hot_evictions
        assert len(list(tmp_path.glob("*/*.kvb"))) == 94

    serve(store, scenario)


@pytest.mark.parametrize("message, code, detail", [
    (kv_block(bytes(16), b"\0" * 100), grpc.StatusCode.INVALID_ARGUMENT, "data is 100 bytes but shape"),
    (kv_block(bytes(8), b"\0" * 4, shape=(1,)), grpc.StatusCode.INVALID_ARGUMENT, "hash is 8 bytes"),
    (kv_block(bytes(16), b"\0" * 4, dtype="complex64", shape=(1,)), grpc.StatusCode.INVALID_ARGUMENT,
     "dtype 'complex64' is not one of"),
    (kv_block(bytes(16), b"\0" * 4096, dtype="uint8", shape=(4096,)), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "fits neither the hot tier's 1024-byte budget"),
])
def test_bad_blocks_fail_precisely(message: cache_pb2.KVBlock, code: grpc.StatusCode, detail: str) -> None:
    store = BlockStore.create(hot_bytes=1024)

    async def scenario(stub: cache_pb2_grpc.CacheStub) -> None:
        good = kv_block(bytes([1]) * 16, b"\0" * 8, dtype="torch.bfloat16", shape=(4,))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PutBlocks(stream([good, message]))
        assert err.value.code() == code and detail in (err.value.details() or "")
        assert await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model=MODEL, version=VERSION,
                                                                   hashes=[bytes([1]) * 16])) == \
            cache_pb2.MatchPrefixResponse(matched=1)          # blocks before the bad one stay stored
        with pytest.raises(grpc.aio.AioRpcError) as err:
            bad_key = cache_pb2.BlockKey(model="", version=VERSION, hash=bytes(16))
            _ = [m async for m in stub.GetBlocks(cache_pb2.GetBlocksRequest(keys=[bad_key]))]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model is empty" in (err.value.details() or "")

    serve(store, scenario)
