"""BlockManager: paged KV bookkeeping, prefix reuse, LRU eviction.  Exact block ids throughout."""

from __future__ import annotations

import pytest

from mesh.prefix import block_hashes
from services.engine.core.block_manager import BlockManager, BlockTable

A = [1, 2, 3, 4, 5]  # block_size 2: two full blocks [1,2] [3,4] and a tail [5]


def committed(bm: BlockManager, tokens: list[int]) -> BlockTable:
    """Allocate `tokens` and mark all of them computed, as after a full prefill."""
    table, _ = bm.allocate(tokens)
    bm.commit(table, tokens, len(tokens))
    return table


# -- allocation and accounting -------------------------------------------------------
def test_rejects_empty_pool_or_zero_block_size() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 2)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_fresh_allocation_takes_blocks_in_order() -> None:
    bm = BlockManager(8, 2)
    t1, c1 = bm.allocate([1, 2, 3, 4, 5])
    t2, c2 = bm.allocate([9, 9, 9])
    assert (t1.blocks, c1) == ([0, 1, 2], 0)
    assert (t2.blocks, c2) == ([3, 4], 0)
    assert bm.num_free_blocks == 3
    assert bm.num_used_blocks == 5
    assert bm.ref == [1, 1, 1, 1, 1, 0, 0, 0]


def test_grow_adds_only_missing_blocks_and_free_returns_them() -> None:
    bm = BlockManager(8, 2)
    t, _ = bm.allocate([1, 2, 3])
    assert (t.blocks, bm.num_free_blocks) == ([0, 1], 6)
    bm.grow(t, 4)
    assert (t.blocks, bm.num_free_blocks) == ([0, 1], 6)
    bm.grow(t, 5)
    assert (t.blocks, bm.num_free_blocks) == ([0, 1, 2], 5)
    bm.grow(t, 8)
    assert (t.blocks, bm.num_free_blocks) == ([0, 1, 2, 3], 4)
    bm.free_table(t)
    assert (t.blocks, t.hashes) == ([], [])
    assert bm.num_free_blocks == 8
    assert bm.ref == [0] * 8
    assert list(bm.free) == [4, 5, 6, 7, 3, 2, 1, 0]  # unhashed: back to the free list, tail first


def test_can_grow_counts_missing_blocks_against_free_pool() -> None:
    bm = BlockManager(3, 2)
    t, _ = bm.allocate([1, 2, 3])
    assert bm.can_grow(t, 6)       # needs 1 more, 1 free
    assert not bm.can_grow(t, 7)   # needs 2 more
    assert bm.can_grow(t, 4)       # needs none


def test_allocating_past_capacity_raises() -> None:
    bm = BlockManager(2, 2)
    bm.allocate([1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate([5])


# -- prefix reuse --------------------------------------------------------------------
def test_committed_prefix_is_reused_with_same_block_ids_and_bumped_refs() -> None:
    bm = BlockManager(8, 2)
    first = committed(bm, A)
    second, cached = bm.allocate(A)
    assert first.blocks == [0, 1, 2]
    assert second.blocks == [0, 1, 3]
    assert cached == 4
    assert second.hashes == first.hashes[:2]
    assert bm.ref[:4] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 4


def test_block_holding_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(8, 2)
    committed(bm, [1, 2, 3, 4])                # both blocks full and registered
    assert len(bm.cached) == 2
    assert bm.match_prefix([1, 2, 3, 4]) == [0]
    table, cached = bm.allocate([1, 2, 3, 4])
    assert (table.blocks, cached) == ([0, 2], 2)
    assert bm.match_prefix([1, 2, 3, 4, 5]) == [0, 1]  # one more token: both blocks usable


def test_single_token_and_single_block_prompts_never_hit() -> None:
    bm = BlockManager(8, 2)
    committed(bm, [1, 2])
    assert bm.match_prefix([1, 2]) == []
    assert bm.match_prefix([1]) == []
    assert bm.match_prefix([]) == []


def test_prompt_sharing_first_block_shares_only_that_block() -> None:
    bm = BlockManager(8, 2)
    committed(bm, A)                           # blocks 0 [1,2], 1 [3,4], 2 [5]
    table, cached = bm.allocate([1, 2, 7, 8, 9])
    assert (table.blocks, cached) == ([0, 3, 4], 2)
    assert bm.ref[:5] == [2, 1, 1, 1, 1]


def test_hashes_are_chained_so_same_block_after_different_prefix_misses() -> None:
    bm = BlockManager(8, 2)
    committed(bm, A)
    assert bm.match_prefix([7, 7, 3, 4, 5]) == []      # [3,4] matches block 1's tokens, not its prefix
    assert bm.match_prefix([1, 2, 3, 4, 5]) == [0, 1]


def test_registered_hashes_agree_with_mesh_prefix() -> None:
    bm = BlockManager(8, 2, namespace=b"m")
    committed(bm, A)
    assert [bm.block_hash[0], bm.block_hash[1]] == block_hashes(A, 2, namespace=b"m")
    assert bm.block_hash[2] is None


def test_namespace_keeps_caches_apart() -> None:
    a, b = BlockManager(8, 2, namespace=b"a"), BlockManager(8, 2, namespace=b"b")
    committed(a, A)
    assert a.cached.keys().isdisjoint(block_hashes(A, 2, namespace=b"b"))
    assert b.match_prefix(A) == []


# -- commit --------------------------------------------------------------------------
def test_commit_registers_only_full_computed_blocks() -> None:
    bm = BlockManager(8, 2)
    t, _ = bm.allocate(A)
    bm.commit(t, A, 1)
    assert (len(t.hashes), bm.cached) == (0, {})
    bm.commit(t, A, 3)                         # block 0 full; block 1 half computed
    assert len(t.hashes) == 1
    assert list(bm.cached.values()) == [0]
    assert bm.block_hash[1] is None
    assert bm.match_prefix(A) == [0]
    bm.commit(t, A, 99)                        # clipped to len(tokens): the tail [5] stays unregistered
    assert len(t.hashes) == 2
    assert list(bm.cached.values()) == [0, 1]
    assert bm.block_hash[2] is None


def test_commit_registers_generated_tokens_once_full() -> None:
    bm = BlockManager(8, 2)
    t, _ = bm.allocate([1, 2, 3])
    bm.commit(t, [1, 2, 3], 3)
    bm.grow(t, 4)
    bm.commit(t, [1, 2, 3, 9], 4)              # token 9 was generated
    assert list(bm.cached.values()) == [0, 1]
    assert bm.match_prefix([1, 2, 3, 9, 0]) == [0, 1]


def test_second_request_with_same_content_does_not_replace_registration() -> None:
    bm = BlockManager(8, 2)
    first, _ = bm.allocate([1, 2, 3])
    second, _ = bm.allocate([1, 2, 3])         # allocated before `first` committed: no hit
    assert (first.blocks, second.blocks) == ([0, 1], [2, 3])
    bm.commit(first, [1, 2, 3], 3)
    bm.commit(second, [1, 2, 3], 3)
    assert list(bm.cached.values()) == [0]
    assert bm.block_hash[2] is None
    assert second.hashes == first.hashes       # its chain still continues correctly
    bm.free_table(second)
    assert list(bm.evictable) == []            # the duplicate is plain free space
    assert list(bm.free)[-2:] == [3, 2]
    assert bm.match_prefix([1, 2, 3]) == [0]


# -- blocks imported from the shared cache ---------------------------------------------
def test_imported_blocks_are_registered_after_the_local_prefix_like_committed_ones() -> None:
    bm = BlockManager(8, 2)
    bm.free_table(committed(bm, [1, 2, 3]))    # block 0 [1,2] cached here, block 1 free again
    hashes = block_hashes(A, 2)
    table, cached = bm.allocate(A)
    assert (table.blocks, cached) == ([0, 2, 3], 2)
    assert bm.register_imported(table, hashes[1:2]) == [2]
    assert table.hashes == hashes
    assert (bm.cached, bm.block_hash[2]) == ({hashes[0]: 0, hashes[1]: 2}, hashes[1])
    assert (bm.hits, bm.imported, bm.queries) == (4, 2, 8)   # hits count local and imported tokens
    assert bm.ref[:4] == [1, 0, 1, 1]
    bm.commit(table, A, 5)                     # the tail [5] is not full: nothing more to register
    assert table.hashes == hashes
    bm.free_table(table)
    assert list(bm.evictable) == [2, 0]
    assert bm.match_prefix(A + [6]) == [0, 2]


def test_an_imported_hash_already_cached_elsewhere_is_not_registered_twice() -> None:
    bm = BlockManager(8, 2)
    hashes = block_hashes(A, 2)
    first, _ = bm.allocate(A)
    second, _ = bm.allocate(A)
    assert bm.register_imported(first, hashes) == [0, 1]
    assert bm.register_imported(second, hashes) == [3, 4]
    assert bm.cached == {hashes[0]: 0, hashes[1]: 1}
    assert (bm.block_hash[3], second.hashes) == (None, hashes)
    bm.free_table(second)
    assert list(bm.evictable) == [] and list(bm.free)[-3:] == [5, 4, 3]


def test_importing_more_blocks_than_the_table_holds_is_refused() -> None:
    bm = BlockManager(8, 2)
    table, _ = bm.allocate([1, 2, 3])
    with pytest.raises(ValueError, match="do not fit"):
        bm.register_imported(table, block_hashes([1, 2, 3, 4, 5, 6], 2))
    assert (table.hashes, bm.cached) == ([], {})


# -- freeing and eviction ------------------------------------------------------------
def test_free_puts_hashed_blocks_in_lru_and_unhashed_in_free_list() -> None:
    bm = BlockManager(8, 2)
    t = committed(bm, A)
    bm.free_table(t)
    assert list(bm.evictable) == [1, 0]        # tail first
    assert list(bm.free) == [3, 4, 5, 6, 7, 2]
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0
    assert bm.match_prefix(A) == [0, 1]        # still cached while evictable


def test_shared_block_is_released_only_by_last_owner() -> None:
    bm = BlockManager(8, 2)
    first = committed(bm, A)
    second, _ = bm.allocate(A)
    bm.free_table(first)
    assert bm.ref[:4] == [1, 1, 0, 1]
    assert list(bm.evictable) == []
    assert bm.num_free_blocks == 5
    bm.free_table(second)
    assert bm.ref[:4] == [0, 0, 0, 0]
    assert list(bm.evictable) == [1, 0]
    assert bm.num_free_blocks == 8


def test_eviction_takes_free_list_first_then_tail_blocks_before_head() -> None:
    bm = BlockManager(4, 2)
    t = committed(bm, A)                       # blocks 0, 1 hashed; 2 not
    bm.free_table(t)
    assert (list(bm.free), list(bm.evictable)) == ([3, 2], [1, 0])
    assert bm.allocate([7, 7])[0].blocks == [3]
    assert bm.allocate([7, 8])[0].blocks == [2]
    assert bm.match_prefix(A) == [0, 1]
    assert bm.allocate([8, 8])[0].blocks == [1]   # A's tail block goes first
    assert bm.match_prefix(A) == [0]
    assert bm.block_hash[1] is None
    assert bm.allocate([9, 9])[0].blocks == [0]
    assert bm.match_prefix(A) == []
    assert bm.cached == {}
    assert bm.num_free_blocks == 0


def test_least_recently_freed_request_is_evicted_first() -> None:
    bm = BlockManager(4, 2)
    a = committed(bm, [1, 2, 3])               # blocks 0 (hashed), 1
    b = committed(bm, [5, 6, 7])               # blocks 2 (hashed), 3
    bm.free_table(a)
    bm.free_table(b)
    assert (list(bm.free), list(bm.evictable)) == ([1, 3], [0, 2])
    t, _ = bm.allocate([9, 9, 9, 9, 9])
    assert t.blocks == [1, 3, 0]
    assert bm.match_prefix([1, 2, 3]) == []
    assert bm.match_prefix([5, 6, 7]) == [2]


def test_reviving_a_cached_block_moves_it_to_the_back_of_the_lru() -> None:
    bm = BlockManager(4, 2)
    a = committed(bm, [1, 2, 3])
    b = committed(bm, [5, 6, 7])
    bm.free_table(a)
    bm.free_table(b)
    again, cached = bm.allocate([1, 2, 3])     # revives block 0, takes free block 1
    assert (again.blocks, cached) == ([0, 1], 2)
    assert list(bm.evictable) == [2]
    bm.free_table(again)
    assert list(bm.evictable) == [2, 0]
    t, _ = bm.allocate([9, 9, 9, 9, 9])
    assert t.blocks == [3, 1, 2]               # b's block 2 is now the oldest
    assert bm.match_prefix([1, 2, 3]) == [0]
    assert bm.match_prefix([5, 6, 7]) == []


# -- can_allocate --------------------------------------------------------------------
def test_can_allocate_counts_revived_evictable_hits_against_free_capacity() -> None:
    bm = BlockManager(4, 2)
    t = committed(bm, A)
    bm.free_table(t)                           # evictable [1, 0], free [3, 2]
    bm.allocate([8])                           # holds block 3: free [2], evictable [1, 0]
    assert bm.num_free_blocks == 3
    longer = [1, 2, 3, 4, 5, 6, 7]             # 4 blocks: 2 hits to revive + 2 new = 4 > 3
    assert bm.match_prefix(longer) == [0, 1]
    assert not bm.can_allocate(longer)
    assert bm.can_allocate(A)                  # 2 revived + 1 new = 3
    assert not bm.can_allocate(A, reserve=1)
    table, cached = bm.allocate(A)
    assert (table.blocks, cached) == ([0, 1, 2], 4)
    assert bm.num_free_blocks == 0
    assert list(bm.evictable) == []


def test_can_allocate_hits_on_blocks_in_use_cost_nothing() -> None:
    bm = BlockManager(4, 2)
    committed(bm, A)                           # still held: blocks 0, 1, 2
    assert bm.num_free_blocks == 1
    assert bm.can_allocate(A)                  # only the tail block is new
    assert not bm.can_allocate(A, reserve=1)
    assert not bm.can_allocate([9, 9, 9])      # no hit: needs 2
    table, cached = bm.allocate(A)
    assert (table.blocks, cached) == ([0, 1, 3], 4)


def test_can_allocate_honours_reserve_without_hits() -> None:
    bm = BlockManager(8, 2)
    prompt = [9] * 12                          # 6 blocks
    assert bm.can_allocate(prompt, reserve=2)
    assert not bm.can_allocate(prompt, reserve=3)
    assert not bm.can_allocate([9] * 17)       # 9 blocks > 8


def test_lookups_do_not_take_blocks() -> None:
    bm = BlockManager(4, 2)
    t = committed(bm, A)
    bm.free_table(t)
    bm.match_prefix(A)
    bm.can_allocate(A)
    assert bm.ref == [0, 0, 0, 0]
    assert list(bm.evictable) == [1, 0]
    assert (bm.hits, bm.queries) == (0, 5)     # only the allocate counted


# -- hit accounting ------------------------------------------------------------------
def test_hits_and_queries_count_prompt_tokens() -> None:
    bm = BlockManager(8, 2)
    assert (bm.hits, bm.queries) == (0, 0)
    committed(bm, A)
    assert (bm.hits, bm.queries) == (0, 5)
    bm.allocate(A)
    assert (bm.hits, bm.queries) == (4, 10)
    bm.allocate([1, 2, 7, 7])
    assert (bm.hits, bm.queries) == (6, 14)


# -- misuse --------------------------------------------------------------------------
def test_freeing_a_block_twice_trips_the_assertion() -> None:
    bm = BlockManager(4, 2)
    t, _ = bm.allocate([1, 2, 3])
    stale = BlockTable(blocks=list(t.blocks))  # a second reference nobody took
    bm.free_table(t)
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free_table(stale)


def test_freeing_the_same_table_again_is_a_no_op() -> None:
    bm = BlockManager(4, 2)
    t, _ = bm.allocate([1, 2, 3])
    bm.free_table(t)
    bm.free_table(t)                           # free_table empties the table
    assert bm.ref == [0, 0, 0, 0]
    assert bm.num_free_blocks == 4
