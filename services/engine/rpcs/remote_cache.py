"""The engine's client of the shared KV-cache service (meshpb.v1.Cache block RPCs).

Before a request is added, the server fetches the prompt blocks this engine lacks and another
engine published: MatchPrefix (no bytes moved), then GetBlocks for the matched ones, decoded
into StagedBlocks.  After a step, the publisher task sends the prompt blocks the engine computed
(kv_transfer.Outbox) with one PutBlocks stream per batch.

Best effort throughout: a missing, slow or dead cache costs speed, never a request.  A failed
call logs one warning and the cache is left alone for `retry_after_s`; fetches meanwhile return
nothing and published batches are dropped.  Protobuf stays in this module and server.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mesh.grpcutil import channel
from meshpb.v1 import cache_pb2, cache_pb2_grpc
from services.engine.core.request import StagedBlock
from services.engine.runtime import kv_transfer
from services.engine.runtime.kv_transfer import KVLayout, Outbox, PublishedBlocks

log = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str], ...]


def kv_version(model_version: str, kv_layout: KVLayout, matmul: str) -> str:
    """The version in the cache's keys: the weights' version plus all that changes a block's bytes
    (KV dtype, the arithmetic that computed it, block size), so no engine loads a foreign layout."""
    return f"{model_version}/{kv_layout.dtype_name}/{matmul}/bs{kv_layout.block_size}"


@dataclass
class RemoteStats:
    """Counters since start (the engine's log and tests read them)."""

    fetched_blocks: int = 0       # blocks received and staged on requests
    rejected_blocks: int = 0      # received but of another layout, or out of order: not used
    published_blocks: int = 0     # blocks a PutBlocks call stored
    dropped_blocks: int = 0       # exported blocks never sent: the cache was down or the call failed
    errors: int = 0               # failed calls


class RemoteCache:
    publish_timeout_s = 30.0                        # one PutBlocks call

    def __init__(self, address: str, model: str, version: str, kv_layout: KVLayout, tenant: str = "standard",
                 timeout_s: float = 2.0, retry_after_s: float = 5.0, pin: bool = False):
        self.address = address
        self.pin = pin                              # fetched blocks in pinned memory (an engine on a GPU)
        self.model = model
        self.version = version
        self.layout = kv_layout
        self.tenant = tenant
        self.timeout_s = timeout_s                  # MatchPrefix + GetBlocks together, per request
        self.retry_after_s = retry_after_s
        self.stats = RemoteStats()
        self._channel = channel(address)
        self._stub = cache_pb2_grpc.CacheStub(self._channel)
        self._down_until = 0.0                      # time.monotonic(): skip the cache until then
        self._failing = False

    async def close(self) -> None:
        await self._channel.close()

    # -- health ------------------------------------------------------------------------
    def _skipped(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, op: str, exc: BaseException) -> None:
        self.stats.errors += 1
        detail = exc.details() if hasattr(exc, "details") else repr(exc)
        if not self._failing:
            log.warning("shared KV cache at %s: %s failed (%s); recomputing without it, retrying in %.0fs",
                        self.address, op, detail, self.retry_after_s)
        else:
            log.debug("shared KV cache at %s: %s failed again (%s)", self.address, op, detail)
        self._failing = True
        self._down_until = time.monotonic() + self.retry_after_s

    def _succeeded(self) -> None:
        if self._failing:
            log.info("shared KV cache at %s answers again", self.address)
        self._failing = False

    # -- fetch -------------------------------------------------------------------------
    def key_version(self, model_version: str) -> str:
        """The cache keys' version for `model_version`'s blocks ("": the engine's first): kv_version's
        layout part stays, the weights' version changes (a hot swap)."""
        return model_version + self.version[self.version.index("/"):] if model_version else self.version

    async def fetch(self, start: int, hashes: Sequence[bytes], metadata: Metadata = (),
                    model_version: str = "") -> list[StagedBlock]:
        """The stored prefix of `hashes` (the prompt's blocks start, start+1, ...), decoded; [] on any failure.
        `metadata` goes with both calls (the trace context)."""
        if not hashes or self._skipped():
            return []
        try:
            staged = await asyncio.wait_for(self._fetch(start, hashes, metadata, self.key_version(model_version)),
                                            self.timeout_s)
        except Exception as exc:                    # best effort: nothing here may fail the request
            self._failed("fetch", exc)
            return []
        self._succeeded()
        return staged

    async def _fetch(self, start: int, hashes: Sequence[bytes], metadata: Metadata, version: str
                     ) -> list[StagedBlock]:
        reply = await self._stub.MatchPrefix(cache_pb2.MatchPrefixRequest(model=self.model, version=version,
                                                                          hashes=hashes), metadata=metadata)
        if not reply.matched:
            return []
        wanted = hashes[:reply.matched]
        keys = [cache_pb2.BlockKey(model=self.model, version=version, hash=h) for h in wanted]
        call = self._stub.GetBlocks(cache_pb2.GetBlocksRequest(keys=keys), metadata=metadata)
        data: list[bytes] = []
        lay = self.layout
        try:
            async for msg in call:
                if (len(data) >= len(wanted) or msg.key.hash != wanted[len(data)] or msg.dtype != lay.dtype_name
                        or tuple(msg.shape) != lay.shape or len(msg.data) != lay.block_bytes):
                    self.stats.rejected_blocks += 1
                    log.warning("shared KV cache at %s sent block %s as %s %s; this engine's blocks are %s %s: "
                                "not used", self.address, msg.key.hash.hex(), msg.dtype, list(msg.shape),
                                lay.dtype_name, list(lay.shape))
                    break
                data.append(msg.data)
        finally:
            call.cancel()                           # a no-op once the stream has ended
        kv = kv_transfer.from_bytes(data, lay, self.pin)     # (n, layers, 2, block_size, kv_heads, head_dim)
        self.stats.fetched_blocks += len(data)
        return [StagedBlock(start + i, h, kv[i]) for i, h in enumerate(wanted[:len(data)])]

    # -- publish -----------------------------------------------------------------------
    async def publish(self, batch: PublishedBlocks) -> int:
        """Send one batch with one PutBlocks stream; returns the blocks stored.  Raises on failure."""
        lay = self.layout
        if batch.ready is not None:                 # a GPU's copy into pinned memory may still be running
            await asyncio.to_thread(batch.ready.synchronize)

        version = self.key_version(batch.version)

        classes = batch.classes or [""] * len(batch.hashes)

        def messages() -> Iterator[cache_pb2.KVBlock]:
            for h, block, sla in zip(batch.hashes, batch.kv, classes, strict=True):
                yield cache_pb2.KVBlock(key=cache_pb2.BlockKey(model=self.model, version=version, hash=h),
                                        data=kv_transfer.to_bytes(block), dtype=lay.dtype_name, shape=lay.shape,
                                        num_tokens=lay.block_size, tenant=sla or self.tenant)

        reply = await self._stub.PutBlocks(messages(), timeout=self.publish_timeout_s)
        self.stats.published_blocks += reply.stored
        return int(reply.stored)

    async def run_publisher(self, outbox: Outbox, wake: asyncio.Event) -> None:
        """Drain `outbox` until cancelled; `wake` is set when a step may have added to it."""
        while True:
            batch = outbox.take()
            if batch is None:
                await wake.wait()
                wake.clear()
                continue
            if self._skipped():
                self.stats.dropped_blocks += len(batch.hashes)
                continue
            try:
                await self.publish(batch)
            except Exception as exc:
                self.stats.dropped_blocks += len(batch.hashes)
                self._failed("PutBlocks", exc)
            else:
                self._succeeded()
