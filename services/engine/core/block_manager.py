"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, prefix reuse.  Pure CPU.

A full block whose KV has been computed is registered under the chained hash of its
tokens; a later request whose prompt starts with the same tokens takes those blocks
instead of computing them.  Unreferenced registered blocks stay cached until the space
is needed, and are evicted least recently used first.  A block whose KV is copied in from
the shared cache (another engine computed it) is registered the same way: `register_imported`.

Invariant: every block is in exactly one of: the free list, the evictable LRU (ref 0,
hashed), or in use (ref > 0).  num_free_blocks counts the first two.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mesh.prefix import block_hash, block_hashes, root


@dataclass
class BlockTable:
    """One request's blocks, in order, and how many of them have a registered hash."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)   # hashes[i] belongs to blocks[i]
    root: bytes = b""                                    # the chain's first parent (namespace + salt)

    def __len__(self) -> int:
        return len(self.blocks)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, namespace: bytes = b""):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.namespace = namespace
        self.ref = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()   # LRU order: oldest first
        self.cached: dict[bytes, int] = {}                       # hash -> block
        self.hits = 0        # prompt tokens served from the prefix cache (local hits and imports)
        self.queries = 0     # prompt tokens looked up
        self.imported = 0    # of the hits, tokens whose KV was imported from the shared cache

    # -- accounting ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup and allocation ------------------------------------------------
    def prefix_hashes(self, tokens: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """Chained hashes of the blocks of `tokens` that may be served from a cache, local or shared;
        `salt` (a request's cache_salt) keeps callers' blocks apart."""
        # The last token is never served from cache: its logits are needed to sample.
        usable = (len(tokens) - 1) // self.block_size * self.block_size
        return block_hashes(tokens[:usable], self.block_size, self.namespace, salt)

    def match_prefix(self, tokens: Sequence[int], salt: bytes = b"") -> list[int]:
        """Blocks holding the longest cached prefix of `tokens` (without taking them)."""
        found: list[int] = []
        for h in self.prefix_hashes(tokens, salt):
            block = self.cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, tokens: Sequence[int], reserve: int = 0, salt: bytes = b"") -> bool:
        hit = self.match_prefix(tokens, salt)
        needed = self.blocks_for(len(tokens)) - len(hit)
        # Cached hits with ref 0 sit in the evictable pool: taking them shrinks it.
        revived = sum(1 for b in hit if self.ref[b] == 0)
        return self.num_free_blocks - revived - needed >= reserve

    def allocate(self, tokens: Sequence[int], salt: bytes = b"") -> tuple[BlockTable, int]:
        """Blocks for all of `tokens`, reusing the cached prefix.  Returns (table, cached tokens).

        The caller checked can_allocate; running out here is a bug, not a condition.
        """
        hit = self.match_prefix(tokens, salt)
        table = BlockTable(root=root(self.namespace, salt))
        for block in hit:
            self._take(block)
            table.blocks.append(block)
            table.hashes.append(self.block_hash[block])  # type: ignore[arg-type]
        for _ in range(self.blocks_for(len(tokens)) - len(hit)):
            table.blocks.append(self._new_block())
        cached_tokens = len(hit) * self.block_size
        self.queries += len(tokens)
        self.hits += cached_tokens
        return table, cached_tokens

    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= self.num_free_blocks

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        """Make `table` hold `num_tokens` tokens (decode appends)."""
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            table.blocks.append(self._new_block())

    def commit(self, table: BlockTable, tokens: Sequence[int], num_computed: int) -> None:
        """Register every block that is full and computed, so later prompts can reuse it."""
        full = min(num_computed, len(tokens)) // self.block_size
        parent = table.hashes[-1] if table.hashes else table.root or self.namespace
        for i in range(len(table.hashes), full):
            parent = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            table.hashes.append(parent)
            block = table.blocks[i]
            if parent not in self.cached:
                self.cached[parent] = block
                self.block_hash[block] = parent

    def register_imported(self, table: BlockTable, hashes: Sequence[bytes]) -> list[int]:
        """Register the table's next blocks, right after its registered prefix, under `hashes` (their
        chained hashes, continuing table.hashes), as commit does once computed: their KV is being
        imported.  Returns their ids; the caller fills them before any model step reads them."""
        start = len(table.hashes)
        if start + len(hashes) > len(table.blocks):
            raise ValueError(f"{len(hashes)} imported blocks after {start} do not fit a table of {len(table)}")
        for i, h in enumerate(hashes, start):
            table.hashes.append(h)
            block = table.blocks[i]
            if h not in self.cached:
                self.cached[h] = block
                self.block_hash[block] = h
        self.hits += len(hashes) * self.block_size
        self.imported += len(hashes) * self.block_size
        return table.blocks[start:start + len(hashes)]

    def free_table(self, table: BlockTable) -> None:
        """Release a request's blocks.  Tail blocks first, so the LRU evicts them first."""
        for block in reversed(table.blocks):
            self.ref[block] -= 1
            assert self.ref[block] >= 0, f"block {block} freed twice"
            if self.ref[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        table.blocks.clear()
        table.hashes.clear()

    # -- internals -------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.evictable[block]
        self.ref[block] += 1

    def _new_block(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            h = self.block_hash[block]
            if h is not None and self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
        else:
            raise RuntimeError("out of KV blocks: the scheduler must check before allocating")
        self.ref[block] = 1
        return block
