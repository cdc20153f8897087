"""KV blocks, their validation, and the RAM hot tier.  Pure: no I/O, callers pass `now`.

A block is the KV of one full block of tokens for every layer, exactly as an engine holds it:
`data` is the row-major bytes of a (layers, 2, block_size, kv_heads, head_dim) tensor in the
engine's KV dtype.  The store never looks inside `data`; it checks that dtype and shape
account for every byte and keys the block by (model, version, chained block hash).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from mesh.errors import InvalidArgument, ResourceExhausted
from mesh.prefix import HASH_BYTES
from services.cache.eviction import EvictionPolicy

# torch dtype name -> bytes per element.  Names as `str(torch.bfloat16)` without "torch.".
DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}
MAX_NAME = 256           # model and version names, characters
MAX_TENANT = 64
MAX_DIMS = 8


class BlockKey(NamedTuple):
    model: str
    version: str
    hash: bytes          # mesh.prefix.block_hash chain: equal hashes mean equal prefixes

    def describe(self) -> str:
        return f"{self.model}@{self.version}/{self.hash.hex()}"


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """Everything about a block but its bytes: what the cold index keeps per file."""

    dtype: str
    shape: tuple[int, ...]
    num_tokens: int
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class Block:
    key: BlockKey
    data: bytes          # never copied by the store: the same object goes in and out
    meta: BlockMeta

    @property
    def nbytes(self) -> int:
        return len(self.data)


def normalize_dtype(dtype: str) -> str:
    return dtype.removeprefix("torch.")


def check_key(key: BlockKey) -> None:
    if not key.model:
        raise InvalidArgument("block key: model is empty")
    if len(key.model) > MAX_NAME or len(key.version) > MAX_NAME:
        raise InvalidArgument(f"block key: model and version must be at most {MAX_NAME} characters")
    if len(key.hash) != HASH_BYTES:
        raise InvalidArgument(f"block key: hash is {len(key.hash)} bytes; mesh.prefix.block_hash makes "
                              f"{HASH_BYTES}-byte chained hashes")


def check_block(block: Block, max_block_bytes: int) -> None:
    """Raise InvalidArgument, with a message naming the block, unless the block is well formed."""
    check_key(block.key)
    m, name = block.meta, block.key.describe()
    if m.dtype not in DTYPE_BYTES:
        raise InvalidArgument(f"block {name}: dtype {m.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if not 1 <= len(m.shape) <= MAX_DIMS or min(m.shape) < 1:
        raise InvalidArgument(f"block {name}: shape {list(m.shape)} must have 1 to {MAX_DIMS} dimensions, "
                              "each at least 1 (layers, 2, block_size, kv_heads, head_dim)")
    expected = math.prod(m.shape) * DTYPE_BYTES[m.dtype]
    if block.nbytes != expected:
        raise InvalidArgument(f"block {name}: data is {block.nbytes} bytes but shape {list(m.shape)} of "
                              f"{m.dtype} needs {expected}")
    if block.nbytes > max_block_bytes:
        raise InvalidArgument(f"block {name}: {block.nbytes} bytes is over the {max_block_bytes}-byte limit "
                              "for one block")
    if m.num_tokens < 1:
        raise InvalidArgument(f"block {name}: num_tokens must be at least 1 (the engine's block size)")
    if len(m.tenant) > MAX_TENANT:
        raise InvalidArgument(f"block {name}: tenant is longer than {MAX_TENANT} characters")


def check_same(stored: BlockMeta, block: Block) -> None:
    """A key names one content: a put that disagrees with the stored block is a caller bug."""
    if (stored.dtype, stored.shape) != (block.meta.dtype, block.meta.shape):
        raise InvalidArgument(
            f"block {block.key.describe()} is stored as {stored.dtype} {list(stored.shape)} but this put "
            f"sends {block.meta.dtype} {list(block.meta.shape)}: the hash namespace must include the KV dtype "
            "and layout")


class Tier:
    """Byte accounting and eviction order for one tier.

    Invariant: `used` == sum(`sizes`) + `reserved`; `used` <= `budget` after every call.
    Bytes are reserved for blocks being written (cold tier) and are not evictable until
    `commit`.
    """

    def __init__(self, name: str, budget: int, policy: EvictionPolicy):
        self.name = name
        self.budget = budget
        self.policy = policy
        self.sizes: dict[BlockKey, int] = {}
        self.used = 0
        self.reserved = 0

    def __len__(self) -> int:
        return len(self.sizes)

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.budget

    def make_room(self, nbytes: int) -> list[BlockKey] | None:
        """Evict (from the index) until `nbytes` more fit; the victims, in eviction order.
        None, evicting nothing, when they cannot fit even with every committed block gone."""
        if self.reserved + nbytes > self.budget:
            return None
        victims: list[BlockKey] = []
        while self.used + nbytes > self.budget:
            key = self.policy.pop()
            assert isinstance(key, BlockKey)
            self.used -= self.sizes.pop(key)
            victims.append(key)
        return victims

    def add(self, key: BlockKey, nbytes: int, tenant: str, now: float) -> None:
        self.sizes[key] = nbytes
        self.used += nbytes
        self.policy.insert(key, now, tenant)

    def discard(self, key: BlockKey) -> int:
        nbytes = self.sizes.pop(key, 0)
        self.used -= nbytes
        self.policy.remove(key)
        return nbytes

    def touch(self, key: BlockKey, now: float) -> None:
        self.policy.touch(key, now)


class HotTier(Tier):
    """Blocks in RAM.  The budget counts payload bytes (not Python's per-object overhead)."""

    def __init__(self, budget: int, policy: EvictionPolicy):
        super().__init__("hot", budget, policy)
        self.blocks: dict[BlockKey, Block] = {}

    def get(self, key: BlockKey, now: float) -> Block | None:
        block = self.blocks.get(key)
        if block is not None:
            self.touch(key, now)
        return block

    def put(self, block: Block, now: float) -> list[Block]:
        """Store `block` (not already here); returns the blocks evicted to make room, for demotion."""
        victims = self.make_room(block.nbytes)
        if victims is None:
            raise ResourceExhausted(f"block {block.key.describe()}: {block.nbytes} bytes is over the hot "
                                    f"tier's {self.budget}-byte budget")
        self.add(block.key, block.nbytes, block.meta.tenant, now)
        self.blocks[block.key] = block
        return [self.blocks.pop(k) for k in victims]
