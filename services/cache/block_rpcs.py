"""The KV block RPCs of meshpb.v1.Cache, as a mixin for the cache servicer (which sets `self.blocks`).

An engine reuses a prefix another engine computed like this (keys from mesh.prefix.block_hashes):
    n = MatchPrefix(model, version, hashes).matched      # one round trip, no bytes moved
    GetBlocks(keys[:n])                                  # one KVBlock per message, in order;
                                                         # may end early if a block was evicted since
and publishes the blocks it computed with one client-streaming PutBlocks call.
Protobuf conversion lives here, at the RPC edge; the store sees only `Block`s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from mesh import peers
from mesh.grpcutil import rpc_errors
from mesh.telemetry import server_span
from meshpb.v1 import cache_pb2
from services.cache.blocks import Block, BlockKey, BlockMeta, normalize_dtype
from services.cache.store import BlockStats, BlockStore


def key_from_pb(key: cache_pb2.BlockKey) -> BlockKey:
    return BlockKey(key.model, key.version, key.hash)


def block_from_pb(msg: cache_pb2.KVBlock) -> Block:
    # Reading a bytes field copies it out of the message once; the store keeps that object.
    return Block(key_from_pb(msg.key), msg.data,
                 BlockMeta(normalize_dtype(msg.dtype), tuple(msg.shape), msg.num_tokens, msg.tenant))


def block_to_pb(block: Block) -> cache_pb2.KVBlock:
    k, m = block.key, block.meta
    return cache_pb2.KVBlock(key=cache_pb2.BlockKey(model=k.model, version=k.version, hash=k.hash), data=block.data,
                             dtype=m.dtype, shape=m.shape, num_tokens=m.num_tokens, tenant=m.tenant)


def stats_to_pb(s: BlockStats) -> cache_pb2.CacheStats:
    return cache_pb2.CacheStats(
        hot_bytes=s.hot_bytes, cold_bytes=s.cold_bytes, hits=s.hits, misses=s.misses,
        evictions=s.hot_evictions + s.cold_evictions, hot_blocks=s.hot_blocks, cold_blocks=s.cold_blocks,
        hot_budget_bytes=s.hot_budget, cold_budget_bytes=s.cold_budget, hot_hits=s.hot_hits,
        hot_misses=s.hot_misses, cold_hits=s.cold_hits, cold_misses=s.cold_misses, hot_evictions=s.hot_evictions,
        cold_evictions=s.cold_evictions, promotions=s.promotions, demotions=s.demotions, corrupt=s.corrupt,
        bytes_in=s.bytes_in, bytes_out=s.bytes_out, match_queried=s.match_queried, match_matched=s.match_matched)


class BlockRPCs:
    """PutBlocks, GetBlocks, MatchPrefix and GetStats over `self.blocks`."""

    blocks: BlockStore

    @rpc_errors
    async def PutBlocks(self, request_iterator: AsyncIterator[cache_pb2.KVBlock], context: grpc.aio.ServicerContext
                        ) -> cache_pb2.PutBlocksResponse:
        peers.require(context, "PutBlocks", peers.BLOCKS)
        with server_span("cache.put_blocks", context) as span:
            stored = added = nbytes = 0
            async for msg in request_iterator:
                block = block_from_pb(msg)
                added += await self.blocks.put(block)
                stored += 1
                nbytes += block.nbytes
            span.set_attribute("blocks", stored)
            span.set_attribute("bytes", nbytes)
            return cache_pb2.PutBlocksResponse(stored=stored, added=added, bytes=nbytes)

    @rpc_errors
    async def GetBlocks(self, request: cache_pb2.GetBlocksRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[cache_pb2.KVBlock]:
        peers.require(context, "GetBlocks", peers.BLOCKS)
        with server_span("cache.get_blocks", context, keys=len(request.keys)) as span:
            sent = 0
            async for block in self.blocks.get_prefix([key_from_pb(k) for k in request.keys]):
                yield block_to_pb(block)
                sent += 1
            span.set_attribute("blocks", sent)

    @rpc_errors
    async def MatchPrefix(self, request: cache_pb2.MatchPrefixRequest, context: grpc.aio.ServicerContext
                          ) -> cache_pb2.MatchPrefixResponse:
        peers.require(context, "MatchPrefix", peers.BLOCKS)
        with server_span("cache.match_prefix", context, hashes=len(request.hashes)) as span:
            matched = self.blocks.match(request.model, request.version, list(request.hashes))
            span.set_attribute("matched", matched)
            return cache_pb2.MatchPrefixResponse(matched=matched)

    def block_stats(self) -> cache_pb2.CacheStats:
        return stats_to_pb(self.blocks.stats())

    @rpc_errors
    async def GetStats(self, request: cache_pb2.CacheStatsRequest, context: grpc.aio.ServicerContext
                       ) -> cache_pb2.CacheStats:
        peers.require(context, "GetStats", peers.BLOCKS)
        return self.block_stats()
