"""The KV block store: validation, exact budgets, demotion/promotion, crash-safe cold files."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TypeVar

import pytest

from mesh.errors import InvalidArgument, ResourceExhausted
from services.cache.blocks import Block, BlockKey, BlockMeta
from services.cache.cold import HEADER_BYTES, TMP_SUFFIX, encode_meta, file_size
from services.cache.store import BlockStore

T = TypeVar("T")
N = 100                                     # payload bytes of a test block


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro
    return asyncio.run(main())


def key(i: int, model: str = "m") -> BlockKey:
    return BlockKey(model, "v1", i.to_bytes(16, "big"))


def blk(i: int, n: int = N, tenant: str = "", dtype: str = "uint8") -> Block:
    data = bytes([i % 251]) * n
    return Block(key(i), data, BlockMeta(dtype, (n,), 16, tenant))


def fsize(b: Block) -> int:
    return file_size(encode_meta(b.key, b.meta), b.nbytes)


def cold_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kvb"))


async def put_all(store: BlockStore, *ids: int) -> None:
    for i in ids:
        await store.put(blk(i))
    await store.flush()


# --- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("block, message", [
    (Block(BlockKey("", "v", bytes(16)), b"x", BlockMeta("uint8", (1,), 16)), "model is empty"),
    (Block(BlockKey("m", "v", bytes(15)), b"x", BlockMeta("uint8", (1,), 16)), "hash is 15 bytes"),
    (Block(key(1), b"xx", BlockMeta("float7", (2,), 16)), "dtype 'float7' is not one of"),
    (Block(key(1), b"x" * 8, BlockMeta("float32", (3,), 16)), "data is 8 bytes but shape [3] of float32 needs 12"),
    (Block(key(1), b"x" * 8, BlockMeta("float32", (2, 0, 1), 16)), "each at least 1"),
    (Block(key(1), b"x" * 8, BlockMeta("float32", (), 16)), "must have 1 to 8 dimensions"),
    (Block(key(1), b"x" * 2048, BlockMeta("uint8", (2048,), 16)), "over the 1024-byte limit"),
    (Block(key(1), b"x", BlockMeta("uint8", (1,), 0)), "num_tokens must be at least 1"),
])
def test_malformed_blocks_are_invalid_argument(block: Block, message: str) -> None:
    store = BlockStore.create(hot_bytes=1 << 20, max_block_bytes=1024)
    with pytest.raises(InvalidArgument) as err:
        run(store.put(block))
    assert message in err.value.message
    assert len(store.hot) == 0


def test_a_key_names_one_content() -> None:
    store = BlockStore.create(hot_bytes=1 << 20)
    run(store.put(blk(1, n=8)))
    with pytest.raises(InvalidArgument, match="stored as uint8 \\[8\\] but this put sends float32 \\[2\\]"):
        run(store.put(Block(key(1), b"x" * 8, BlockMeta("float32", (2,), 16))))


def test_match_validates_hashes() -> None:
    store = BlockStore.create(hot_bytes=1 << 20)
    with pytest.raises(InvalidArgument, match="hash is 3 bytes"):
        store.match("m", "v1", [b"abc"])
    with pytest.raises(InvalidArgument, match="model is empty"):
        store.match("", "v1", [bytes(16)])


# --- hot tier -----------------------------------------------------------------------------------

def test_hot_budget_is_exact_and_lru_evicts() -> None:
    store = BlockStore.create(hot_bytes=3 * N)
    run(put_all(store, 1, 2, 3))
    s = store.stats()
    assert (s.hot_bytes, s.hot_blocks, s.hot_evictions) == (3 * N, 3, 0)
    assert run(store.get(key(1))) is not None       # 1 is now the most recent
    assert run(store.put(blk(4))) is True
    assert key(2) not in store and key(1) in store
    assert run(store.put(blk(4))) is False          # already stored: a touch
    s = store.stats()
    assert (s.hot_bytes, s.hot_blocks, s.hot_evictions, s.demotions) == (3 * N, 3, 1, 0)
    assert run(store.get(key(2))) is None
    s = store.stats()
    assert (s.hits, s.misses, s.hot_hits, s.hot_misses, s.cold_misses) == (1, 1, 1, 1, 0)
    assert (s.bytes_in, s.bytes_out) == (5 * N, N)


def test_get_returns_the_stored_bytes_object() -> None:
    store = BlockStore.create(hot_bytes=1 << 20)
    b = blk(1)
    run(store.put(b))
    got = run(store.get(key(1)))
    assert got is not None and got.data is b.data and got.meta == b.meta


def test_match_counts_the_stored_prefix() -> None:
    store = BlockStore.create(hot_bytes=10 * N)
    run(put_all(store, 0, 1, 2, 4))
    hashes = [key(i).hash for i in range(6)]
    assert store.match("m", "v1", hashes) == 3
    assert store.match("m", "v1", hashes[3:]) == 0
    assert store.match("m", "v2", hashes) == 0      # another version: nothing
    assert store.match("m", "v1", []) == 0
    s = store.stats()
    assert (s.match_queried, s.match_matched, s.hits) == (6 + 3 + 6, 3, 0)


def test_tenant_priority_in_the_store() -> None:
    store = BlockStore.create(hot_bytes=2 * N, eviction="tenant")
    run(store.put(blk(1, tenant="premium")))
    run(store.put(blk(2, tenant="batch")))
    run(store.put(blk(3, tenant="standard")))
    assert key(2) not in store and key(1) in store and key(3) in store


def test_a_block_over_every_budget_is_refused() -> None:
    store = BlockStore.create(hot_bytes=N - 1)
    with pytest.raises(ResourceExhausted, match="fits neither the hot tier's 99-byte budget nor no cold tier"):
        run(store.put(blk(1)))


# --- cold tier: demotion, promotion, budgets ------------------------------------------------------

def test_demotion_then_promotion_keeps_a_clean_copy(tmp_path: Path) -> None:
    store = BlockStore.create(hot_bytes=2 * N, cold_dir=tmp_path, cold_bytes=1 << 20)
    run(put_all(store, 1, 2, 3))                    # 1 is pushed out of RAM onto disk
    s = store.stats()
    assert (s.hot_blocks, s.cold_blocks, s.hot_evictions, s.demotions) == (2, 1, 1, 1)
    assert s.cold_bytes == fsize(blk(1)) == sum(p.stat().st_size for p in cold_files(tmp_path))
    assert store.match("m", "v1", [key(i).hash for i in (1, 2, 3)]) == 3

    async def promote() -> Block | None:
        got = await store.get(key(1))               # cold hit: promoted, pushing 2 onto disk
        await store.flush()
        return got

    got = run(promote())
    assert got is not None and got.data == blk(1).data
    s = store.stats()
    assert (s.cold_hits, s.hot_misses, s.promotions, s.hot_evictions, s.demotions) == (1, 1, 1, 2, 2)
    assert key(1) in store.hot and key(1) in store.cold   # the file stays as a clean copy
    mtime = store.cold.path(key(1)).stat().st_mtime_ns if store.cold else 0
    run(put_all(store, 4, 5))                       # 3 then 1 leave RAM; 1 needs no new write
    assert store.cold is not None and store.cold.path(key(1)).stat().st_mtime_ns == mtime
    s = store.stats()
    assert (s.hot_evictions, s.demotions, s.cold_blocks) == (4, 4, 3)
    assert s.cold_bytes == 3 * fsize(blk(1)) == sum(p.stat().st_size for p in cold_files(tmp_path))


def test_cold_budget_is_exact_and_evicts_files(tmp_path: Path) -> None:
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=2 * fsize(blk(1)))
    run(put_all(store, 1, 2, 3, 4))                 # 1, 2, 3 demoted; 1's file makes room for 3's
    s = store.stats()
    assert (s.cold_blocks, s.cold_evictions, s.cold_bytes) == (2, 1, 2 * fsize(blk(1)))
    assert len(cold_files(tmp_path)) == 2
    assert key(1) not in store and run(store.get(key(1))) is None
    s = store.stats()
    assert (s.misses, s.cold_misses) == (1, 1)


def test_a_block_over_the_hot_budget_is_stored_cold_only(tmp_path: Path) -> None:
    store = BlockStore.create(hot_bytes=N // 2, cold_dir=tmp_path, cold_bytes=1 << 20)
    assert run(store.put(blk(1))) is True
    assert key(1) not in store.hot and key(1) in store.cold
    got = run(store.get(key(1)))
    assert got is not None and got.data == blk(1).data
    assert store.stats().promotions == 0            # it cannot fit in RAM
    small = BlockStore.create(hot_bytes=N // 2, cold_dir=tmp_path / "small", cold_bytes=N)
    with pytest.raises(ResourceExhausted, match="nor the cold tier's 100-byte budget"):
        run(small.put(blk(2)))


def blocking_writes(store: BlockStore) -> threading.Event:
    """Make the cold tier's writes wait for the returned event."""
    assert store.cold is not None
    release = threading.Event()
    write = store.cold.write_file

    def slow_write(block: Block, meta: bytes) -> None:
        release.wait(10)
        write(block, meta)

    store.cold.write_file = slow_write              # type: ignore[method-assign]
    return release


def test_blocks_being_written_are_served_from_memory(tmp_path: Path) -> None:
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    release = blocking_writes(store)

    async def scenario() -> None:
        await store.put(blk(1))
        await store.put(blk(2))                     # demotes 1; put does not wait for the write
        assert store.stats().pending == 1
        assert store.cold is not None and key(1) not in store.hot and key(1) not in store.cold
        assert store.match("m", "v1", [key(1).hash, key(2).hash]) == 2
        got = await store.get(key(1))
        assert got is not None and got.data == blk(1).data
        await asyncio.sleep(0)                      # the writer task starts: reserves, then blocks in its thread
        assert store.stats().cold_bytes == fsize(blk(1))
        release.set()
        await store.flush()
        assert key(1) in store.cold and store.stats().pending == 0

    run(scenario())


def test_put_waits_while_too_many_writes_are_in_flight(tmp_path: Path) -> None:
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    store.max_pending_bytes = N
    release = blocking_writes(store)

    async def scenario() -> None:
        await store.put(blk(1))
        await store.put(blk(2))                     # 1 in flight: N bytes, not over the limit
        third = asyncio.create_task(store.put(blk(3)))   # 1 and 2 in flight: over it
        for _ in range(20):
            await asyncio.sleep(0.005)
        assert not third.done() and store.stats().pending == 2
        release.set()
        assert await third is True
        await store.flush()
        assert store.stats().cold_blocks == 2

    run(scenario())


def test_get_prefix_stops_at_the_first_missing_block(tmp_path: Path) -> None:
    store = BlockStore.create(hot_bytes=2 * N, cold_dir=tmp_path, cold_bytes=1 << 20)
    run(put_all(store, 0, 1, 2, 3, 5))              # 0, 1, 2 on disk; 3, 5 in RAM

    async def collect(ids: list[int], stop_after: int = 99) -> list[int]:
        got = []
        async for b in store.get_prefix([key(i) for i in ids]):
            assert b.data == blk(b.key.hash[-1]).data
            got.append(b.key.hash[-1])
            if len(got) == stop_after:
                break
        await store.flush()
        return got

    assert run(collect([0, 1, 2, 3, 4, 5])) == [0, 1, 2, 3]
    assert run(collect([4, 5])) == []
    assert run(collect([5, 0, 1], stop_after=1)) == [5]   # the read-ahead of 0 is cancelled or finishes
    with pytest.raises(InvalidArgument, match="hash is 2 bytes"):
        run(_first(store.get_prefix([key(0), BlockKey("m", "v1", b"xx")])))


async def _first(blocks: AsyncIterator[Block]) -> None:
    async for _ in blocks:
        break


def test_a_failed_write_drops_the_block_and_frees_its_reservation(tmp_path: Path) -> None:
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    assert store.cold is not None

    def disk_full(block: Block, meta: bytes) -> None:
        raise OSError(28, "No space left on device")

    store.cold.write_file = disk_full               # type: ignore[method-assign]
    run(put_all(store, 1, 2))
    s = store.stats()
    assert (s.hot_evictions, s.demotions, s.cold_blocks, s.cold_bytes, s.pending) == (1, 0, 0, 0, 0)
    assert key(1) not in store


# --- crash safety and restart ---------------------------------------------------------------------

def fill_cold(folder: Path, ids: range) -> None:
    store = BlockStore.create(hot_bytes=N, cold_dir=folder, cold_bytes=1 << 20)
    run(put_all(store, *ids))                       # all but the last are on disk


def test_restart_keeps_the_cold_tier(tmp_path: Path) -> None:
    fill_cold(tmp_path, range(6))
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    s = store.stats()
    assert (s.cold_blocks, s.cold_bytes, s.hot_blocks, s.corrupt) == (5, 5 * fsize(blk(0)), 0, 0)
    assert store.match("m", "v1", [key(i).hash for i in range(6)]) == 5
    for i in range(5):
        got = run(store.get(key(i)))
        assert got is not None and got.data == blk(i).data and got.meta == blk(i).meta


def test_restart_over_a_smaller_budget_drops_the_oldest(tmp_path: Path) -> None:
    fill_cold(tmp_path, range(6))
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    for i in range(5):                      # file times can tie at the clock's granularity
        assert store.cold is not None
        os.utime(store.cold.path(key(i)), ns=(10**18 + i, 10**18 + i))
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=3 * fsize(blk(0)))
    assert len(store.cold or ()) == 3 and len(cold_files(tmp_path)) == 3
    s = store.stats()
    assert (s.cold_evictions, s.corrupt) == (2, 0)
    assert store.match("m", "v1", [key(i).hash for i in range(2, 5)]) == 3


def test_torn_and_foreign_files_are_deleted_at_startup(tmp_path: Path) -> None:
    fill_cold(tmp_path, range(6))
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    assert store.cold is not None
    torn, header_only, wrong_name = (store.cold.path(key(i)) for i in (0, 1, 2))
    os.truncate(torn, torn.stat().st_size - 10)             # a write cut short
    os.truncate(header_only, HEADER_BYTES - 1)
    wrong_name.rename(wrong_name.with_name("0" * 32 + ".kvb"))   # holds key 2 under another name
    stray = torn.parent / f"abc.{'1' * 32}{TMP_SUFFIX}"     # a crash before the rename
    stray.write_bytes(b"partial")
    garbage = torn.parent / ("f" * 32 + ".kvb")
    garbage.write_bytes(b"not a block file at all" * 10)
    unrelated = tmp_path / "README"
    unrelated.write_text("left alone")

    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    s = store.stats()
    assert (s.cold_blocks, s.corrupt) == (2, 5)
    assert s.cold_bytes == 2 * fsize(blk(0)) == sum(p.stat().st_size for p in cold_files(tmp_path))
    for path in (torn, header_only, stray, garbage, wrong_name.with_name("0" * 32 + ".kvb")):
        assert not path.exists()
    assert unrelated.exists()
    assert store.match("m", "v1", [key(i).hash for i in range(3, 6)]) == 2


def flip_payload_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_bad_checksum_is_never_served(tmp_path: Path) -> None:
    fill_cold(tmp_path, range(4))
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    assert store.cold is not None
    bad = store.cold.path(key(1))
    flip_payload_byte(bad)

    # The fast startup scan checks structure only; the checksum is checked on every read.
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    assert store.match("m", "v1", [key(i).hash for i in range(3)]) == 3
    assert run(store.get(key(0))) is not None
    assert run(store.get(key(1))) is None
    assert not bad.exists() and key(1) not in store
    s = store.stats()
    assert (s.corrupt, s.cold_hits, s.cold_misses, s.misses) == (1, 1, 1, 1)
    assert store.match("m", "v1", [key(i).hash for i in range(3)]) == 1


def test_a_verifying_scan_deletes_bad_checksums_at_startup(tmp_path: Path) -> None:
    fill_cold(tmp_path, range(4))
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    assert store.cold is not None
    bad = store.cold.path(key(2))
    flip_payload_byte(bad)
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20, verify_on_scan=True)
    s = store.stats()
    assert (s.cold_blocks, s.corrupt) == (2, 1) and not bad.exists()


def test_a_file_deleted_behind_the_stores_back_is_a_miss(tmp_path: Path) -> None:
    fill_cold(tmp_path, range(3))
    store = BlockStore.create(hot_bytes=N, cold_dir=tmp_path, cold_bytes=1 << 20)
    assert store.cold is not None
    store.cold.path(key(0)).unlink()
    assert run(store.get(key(0))) is None
    s = store.stats()
    assert (s.corrupt, s.misses, s.cold_blocks) == (0, 1, 1)
