"""BlockStore: the shared KV block store, a RAM hot tier over an optional disk cold tier.

- put: a new block goes hot; the blocks it pushes out are demoted (written cold) rather than
  dropped.  A block over the hot budget goes straight to the cold tier; one that fits neither
  tier is refused with RESOURCE_EXHAUSTED.  Re-putting a stored key only refreshes its recency.
- get: hot, then cold.  A cold hit is checksum-verified, served, and promoted to hot; its file
  stays as a clean copy, so demoting it again costs no write.  A block may so sit in both tiers
  and count in both tiers' bytes.
- Cold files are written one at a time, in demotion order, by one writer task (the I/O itself
  in a worker thread), so the cold tier's eviction order is exactly the demotion order.  A
  block on its way to disk stays in memory (in `_pending`, found by get and match) until its
  file is renamed into place and indexed.  Writes overlap the RPCs: put waits only while more
  than `max_pending_bytes` wait to be written (backpressure); get never waits for a write, and
  `get_prefix` reads the next cold block while the current one is being sent.

Concurrency: all state changes happen on the event loop; only whole-file reads and writes run in
threads.  Time is a logical clock that ticks on every access, so eviction orders are exact.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from mesh.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.cache.blocks import Block, BlockKey, BlockMeta, HotTier, check_block, check_key, check_same
from services.cache.cold import ColdTier, CorruptBlock, encode_meta, file_size
from services.cache.eviction import DEFAULT_WEIGHTS, make_policy

log = logging.getLogger(__name__)

DEFAULT_MAX_BLOCK_BYTES = 32 << 20    # a gRPC message carries one block; mesh.grpcutil allows 64 MiB
MAX_KEYS = 16_384                     # per GetBlocks / MatchPrefix: 256k tokens of 16-token blocks
MAX_PENDING_BYTES = 64 << 20          # cold writes in flight before put waits for them


@dataclass
class BlockStats:
    """Counters since start, and sizes now.  GetStats and /metrics report exactly these."""

    hits: int = 0              # get() found the block in some tier
    misses: int = 0            # get() found it nowhere
    hot_hits: int = 0
    hot_misses: int = 0
    cold_hits: int = 0
    cold_misses: int = 0       # looked up cold (after a hot miss) and not there, or corrupt
    bytes_in: int = 0          # payload bytes accepted by put()
    bytes_out: int = 0         # payload bytes served by get()
    hot_evictions: int = 0     # blocks pushed out of RAM (each then demoted, or dropped without a cold tier)
    cold_evictions: int = 0    # files deleted to make room
    promotions: int = 0        # cold hits copied into RAM
    demotions: int = 0         # hot evictions that now live on disk
    corrupt: int = 0           # torn or corrupt files found (on read or at startup) and deleted
    match_queried: int = 0     # hashes asked about by match()
    match_matched: int = 0     # of which matched
    hot_bytes: int = 0
    hot_blocks: int = 0
    hot_budget: int = 0
    cold_bytes: int = 0        # file sizes (header + metadata + payload), including writes in flight
    cold_blocks: int = 0
    cold_budget: int = 0
    pending: int = 0           # blocks queued for the disk or being written (still in memory)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class BlockStore:
    def __init__(self, hot: HotTier, cold: ColdTier | None = None, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
                 max_pending_bytes: int = MAX_PENDING_BYTES):
        self.hot = hot
        self.cold = cold
        self.max_block_bytes = max_block_bytes
        self.max_pending_bytes = max_pending_bytes
        self.counters = BlockStats()
        # Blocks waiting to be written cold, in order; each with its outcome (True: indexed).
        self._pending: dict[BlockKey, tuple[Block, asyncio.Future[bool]]] = {}
        self._queue: deque[tuple[Block, bool]] = deque()    # (block, is a demotion)
        self._pending_bytes = 0
        self._writer: asyncio.Task[None] | None = None
        self._clock = 0

    @classmethod
    def create(cls, hot_bytes: int, cold_dir: str | Path | None = None, cold_bytes: int = 0, eviction: str = "lru",
               weights: Mapping[str, float] = DEFAULT_WEIGHTS, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
               verify_on_scan: bool = False) -> BlockStore:
        """Both tiers with fresh policies; an existing cold folder is scanned and kept."""
        hot = HotTier(hot_bytes, make_policy(eviction, weights))
        cold = None
        if cold_dir:
            cold = ColdTier(cold_dir, cold_bytes, make_policy(eviction, weights), max_block_bytes)
        store = cls(hot, cold, max_block_bytes)
        if cold is not None:
            report = cold.scan(verify_on_scan)
            store.counters.corrupt += report.removed
            store.counters.cold_evictions += report.evicted
            log.info("cold tier %s: %d blocks (%d bytes) kept, %d bad files removed, %d evicted over budget",
                     cold_dir, report.kept, cold.used, report.removed, report.evicted)
        return store

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _meta(self, key: BlockKey) -> BlockMeta | None:
        block = self.hot.blocks.get(key) or self._pending.get(key, (None,))[0]
        if block is not None:
            return block.meta
        return self.cold.entries.get(key) if self.cold is not None else None

    def __contains__(self, key: object) -> bool:
        return key in self.hot or key in self._pending or (self.cold is not None and key in self.cold)

    def match(self, model: str, version: str, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, are stored in any tier.  Not an access."""
        if len(hashes) > MAX_KEYS:
            raise InvalidArgument(f"{len(hashes)} hashes is over the limit of {MAX_KEYS} per call")
        matched = 0
        for h in hashes:
            key = BlockKey(model, version, h)
            check_key(key)
            if key not in self:
                break
            matched += 1
        self.counters.match_queried += len(hashes)
        self.counters.match_matched += matched
        return matched

    async def put(self, block: Block) -> bool:
        """Store `block`; True if it was not stored before.  Validates it first."""
        check_block(block, self.max_block_bytes)
        key, n = block.key, block.nbytes
        stored = self._meta(key)
        if stored is not None:
            check_same(stored, block)
        now = self._tick()
        self.counters.bytes_in += n
        if key in self.hot:
            self.hot.touch(key, now)
            return False
        if self.hot.fits(n):
            await self._demote(self.hot.put(block, now), wait=True)
            return stored is None
        if self.cold is not None and self.cold.fits(file_size(encode_meta(key, block.meta), n)):
            if key in self.cold:
                self.cold.touch(key, now)
                return False
            if not await asyncio.shield(self._write(block, demotion=False)):
                raise Unavailable(f"block {key.describe()}: the cold tier could not store it (see the cache's log)")
            return stored is None
        cold = f"the cold tier's {self.cold.budget}" if self.cold is not None else "no cold tier, 0"
        raise ResourceExhausted(f"block {key.describe()}: {n} bytes fits neither the hot tier's {self.hot.budget}-byte "
                                f"budget nor {cold}-byte budget; raise --hot-mb or --cold-mb")

    async def get(self, key: BlockKey) -> Block | None:
        check_key(key)
        now = self._tick()
        block = self.hot.get(key, now)
        if block is None and key in self._pending:
            block = self._pending[key][0]                 # on its way to disk: still in memory
        if block is not None:
            self._hit(block, "hot")
            return block
        self.counters.hot_misses += 1
        if self.cold is None or key not in self.cold:
            self._miss()
            return None
        self.cold.touch(key, now)
        try:
            block = await asyncio.to_thread(self.cold.read_file, key)
        except (CorruptBlock, OSError) as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("cold tier: dropping %s: %s", key.describe(), exc)
                self.counters.corrupt += 1
            if key in self.cold:
                self.cold.drop(key)                       # stale index entry or bad file: never served
            self._miss()
            return None
        self._hit(block, "cold")
        if key not in self.hot and self.hot.fits(block.nbytes):
            self.counters.promotions += 1
            await self._demote(self.hot.put(block, self._tick()), wait=False)
        return block

    async def get_prefix(self, keys: Sequence[BlockKey]) -> AsyncIterator[Block]:
        """The blocks of `keys` in order, stopping at the first one not stored (the rest would be
        useless to an engine).  Reads one block ahead, so a disk read overlaps the caller's send."""
        if len(keys) > MAX_KEYS:
            raise InvalidArgument(f"{len(keys)} keys is over the limit of {MAX_KEYS} per call")
        for key in keys:
            check_key(key)                                # a bad key fails before any block is sent
        ahead: asyncio.Task[Block | None] | None = None
        try:
            for i, key in enumerate(keys):
                block = await ahead if ahead is not None else await self.get(key)
                ahead = None
                if block is None:
                    return
                if i + 1 < len(keys):
                    ahead = asyncio.ensure_future(self.get(keys[i + 1]))
                yield block
        finally:
            if ahead is not None:
                ahead.cancel()

    def _hit(self, block: Block, tier: str) -> None:
        self.counters.hits += 1
        self.counters.bytes_out += block.nbytes
        if tier == "hot":
            self.counters.hot_hits += 1
        else:
            self.counters.cold_hits += 1

    def _miss(self) -> None:
        self.counters.misses += 1
        if self.cold is not None:
            self.counters.cold_misses += 1

    async def _demote(self, victims: list[Block], wait: bool) -> None:
        """Move blocks pushed out of RAM to disk (or drop them, without a cold tier)."""
        self.counters.hot_evictions += len(victims)
        if self.cold is None:
            return
        for block in victims:
            if block.key in self.cold:
                self.counters.demotions += 1              # its clean copy is already on disk
            else:
                self._write(block, demotion=True)
        # asyncio.wait never cancels what it waits for: a cancelled put leaves the writes queued.
        while wait and self._pending_bytes > self.max_pending_bytes:
            await asyncio.wait([done for _, done in self._pending.values()], return_when=asyncio.FIRST_COMPLETED)

    def _write(self, block: Block, demotion: bool) -> asyncio.Future[bool]:
        """Queue `block` for the cold tier; the future says whether it got there."""
        if block.key in self._pending:
            return self._pending[block.key][1]
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending[block.key] = (block, done)
        self._pending_bytes += block.nbytes
        self._queue.append((block, demotion))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_queue())
        return done

    async def _write_queue(self) -> None:
        assert self.cold is not None
        try:
            while self._queue:
                block, demotion = self._queue.popleft()
                ok = await self._write_file(self.cold, block)
                self.counters.demotions += ok and demotion
                _, done = self._pending.pop(block.key)
                self._pending_bytes -= block.nbytes
                done.set_result(ok)
        finally:
            self._writer = None

    async def _write_file(self, cold: ColdTier, block: Block) -> bool:
        meta_bytes = encode_meta(block.key, block.meta)
        size = file_size(meta_bytes, block.nbytes)
        # Only this write holds a reservation, so a file within the budget always finds room.
        victims = cold.reserve(size)
        if victims is None:
            log.warning("cold tier: %s (%d bytes) is over the %d-byte budget", block.key.describe(), size,
                        cold.budget)
            return False
        self.counters.cold_evictions += len(victims)
        try:
            await asyncio.to_thread(cold.write_file, block, meta_bytes)
        except Exception as exc:
            cold.release(size)
            log.warning("cold tier: cannot write %s: %s", block.key.describe(), exc)
            return False
        cold.commit(block, size, self._tick())
        return True

    async def flush(self) -> None:
        """Wait until every queued cold write is done (tests; a clean stop)."""
        while self._pending:
            await asyncio.wait([done for _, done in self._pending.values()])

    def stats(self) -> BlockStats:
        s = BlockStats(**self.counters.as_dict())
        s.hot_bytes, s.hot_blocks, s.hot_budget = self.hot.used, len(self.hot), self.hot.budget
        if self.cold is not None:
            s.cold_bytes, s.cold_blocks, s.cold_budget = self.cold.used, len(self.cold), self.cold.budget
        s.pending = len(self._pending)
        return s
