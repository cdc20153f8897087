"""KV blocks between the runner's paged cache and the shared cache's wire format.

The runner's cache is `kv`: one (k_cache, v_cache) pair per layer, each (num_blocks, block_size,
kv_heads, head_dim).  The shared cache holds one block as the row-major bytes of a
(layers, 2, block_size, kv_heads, head_dim) tensor (services/cache/blocks.py).  The copies run
in the step thread (export after the step, import before the model runs); the bytes are made
and parsed by the server's asyncio tasks (remote_cache.py).  The Outbox hands exported blocks
from the one to the other.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

KVCache = Sequence[tuple[torch.Tensor, torch.Tensor]]


class KVLayout(NamedTuple):
    """What one block of a runner's KV is: blocks of another layout must never be loaded."""

    dtype: torch.dtype
    shape: tuple[int, ...]          # (layers, 2, block_size, kv_heads, head_dim)

    @property
    def dtype_name(self) -> str:    # as the cache service names it: "float32", "bfloat16"
        return str(self.dtype).removeprefix("torch.")

    @property
    def block_size(self) -> int:
        return self.shape[2]

    @property
    def block_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def layout(kv: KVCache) -> KVLayout:
    k = kv[0][0]
    return KVLayout(k.dtype, (len(kv), 2, *k.shape[1:]))


class Exported(NamedTuple):
    kv: torch.Tensor                # (n, layers, 2, block_size, kv_heads, head_dim), CPU (pinned from a GPU)
    ready: Any                      # a torch.cuda.Event the copy completes; None: complete already

    def wait(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.kv


def int64_on(device: torch.device, values: Sequence[int]) -> torch.Tensor:
    """Integers as one int64 tensor on `device`.  To a GPU the copy is from pinned memory and does not
    wait for it (a copy from pageable memory synchronises the stream first); the caching host
    allocator keeps the pinned buffer until the copy is done."""
    ids = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


def int64_parts(device: torch.device, *parts: Sequence[int]) -> list[torch.Tensor]:
    """Integer lists as int64 tensors on `device`, with one host-to-device copy that does not wait for
    the GPU (int64_on); the tensors are views of it.  A step's inputs go to the device this way."""
    flat = int64_on(device, [v for part in parts for v in part])
    out, at = [], 0
    for part in parts:
        out.append(flat[at:at + len(part)])
        at += len(part)
    return out


@torch.inference_mode()
def export_blocks_async(kv: KVCache, block_ids: Sequence[int]) -> Exported:
    """Copy the blocks out; on a GPU into pinned host memory without waiting for it.

    The gather runs on the device, then one device-to-host copy is queued behind the step's work;
    the caller (the publisher) waits for `ready` before it reads the bytes, in its own thread."""
    k0 = kv[0][0]
    ids = int64_on(k0.device, block_ids)
    out = torch.empty((len(block_ids), len(kv), 2, *k0.shape[1:]), dtype=k0.dtype, device=k0.device)
    for layer, (k, v) in enumerate(kv):
        out[:, layer, 0] = k.index_select(0, ids)
        out[:, layer, 1] = v.index_select(0, ids)
    if k0.device.type != "cuda":
        return Exported(out.cpu(), None)
    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
    host.copy_(out, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return Exported(host, ready)


@torch.inference_mode()
def import_blocks(kv: KVCache, imports: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Write each (block id, (layers, 2, block_size, kv_heads, head_dim) tensor) into the cache.

    Blocks that from_bytes(pin=True) made reach a GPU by a copy that does not wait for it."""
    if not imports:
        return
    k0 = kv[0][0]
    ids = int64_on(k0.device, [block for block, _ in imports])
    data = _stacked([t for _, t in imports])                  # (n, layers, 2, block_size, kv_heads, head_dim)
    data = data.to(k0.device, non_blocking=data.is_pinned())
    for layer, (k, v) in enumerate(kv):
        k.index_copy_(0, ids, data[:, layer, 0])
        v.index_copy_(0, ids, data[:, layer, 1])


def _stacked(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """(n, *shape) of n same-shaped blocks; without a copy when they are consecutive rows of one
    tensor, as from_bytes makes them (a 1,500-token prompt is ~70 MB of fp32 KV: a copy shows in TTFT)."""
    first = blocks[0]
    step = first.numel()
    storage = first.untyped_storage().data_ptr()
    if first.is_contiguous() and all(
            b.is_contiguous() and b.shape == first.shape and b.dtype == first.dtype
            and b.untyped_storage().data_ptr() == storage and b.storage_offset() == first.storage_offset() + i * step
            for i, b in enumerate(blocks)):
        return first.as_strided((len(blocks), *first.shape), (step, *first.stride()))
    return torch.stack(list(blocks))


def to_bytes(block: torch.Tensor) -> bytes:
    """The row-major bytes of one block (any dtype, bfloat16 included)."""
    return block.contiguous().view(torch.uint8).numpy().tobytes()


def from_bytes(blocks: Sequence[bytes], kv_layout: KVLayout, pin: bool = False) -> torch.Tensor:
    """Blocks of `kv_layout` (each exactly block_bytes long) as one (n, *shape) tensor, one copy.

    pin=True (an engine on a GPU): the tensor is in pinned host memory, so import_blocks moves it
    to the device with an asynchronous copy."""
    if not blocks:
        return torch.empty((0, *kv_layout.shape), dtype=kv_layout.dtype)
    if pin:
        size = kv_layout.block_bytes
        out = torch.empty(len(blocks) * size, dtype=torch.uint8, pin_memory=True)
        view = out.numpy()
        for i, block in enumerate(blocks):
            view[i * size:(i + 1) * size] = memoryview(block)
        return out.view(kv_layout.dtype).reshape(len(blocks), *kv_layout.shape)
    buffer = bytearray().join(blocks)       # writable: torch.frombuffer shares it without a warning
    return torch.frombuffer(buffer, dtype=kv_layout.dtype).reshape(len(blocks), *kv_layout.shape)


class PublishedBlocks(NamedTuple):
    """A batch of exported prompt blocks in the Outbox, by their hashes."""

    hashes: list[bytes]
    kv: torch.Tensor                # (n, layers, 2, block_size, kv_heads, head_dim), CPU
    ready: Any = None               # the Exported copy's event: wait for it before reading kv
    version: str = ""               # the model version that computed them ("": the engine's first)
    classes: list[str] | None = None    # each block's eviction class ("": the engine's --cache-tenant)


class Outbox:
    """Exported prompt blocks on their way to the shared cache: the step thread puts, the server's
    publisher takes.  Bounded in bytes: when the cache is slow or down, the oldest batches are
    dropped (the shared cache speeds engines up; it must never hold their memory hostage)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError("the outbox needs a positive byte budget")
        self.max_bytes = max_bytes
        self._items: deque[PublishedBlocks] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self.put_blocks = 0         # blocks handed in since start
        self.dropped_blocks = 0     # of which were dropped for room, never sent

    def __len__(self) -> int:
        return len(self._items)

    def put(self, hashes: list[bytes], kv: torch.Tensor, ready: Any = None, version: str = "",
            classes: list[str] | None = None) -> None:
        with self._lock:
            self._items.append(PublishedBlocks(hashes, kv, ready, version, classes))
            self._bytes += kv.nbytes
            self.put_blocks += len(hashes)
            while self._bytes > self.max_bytes:
                old = self._items.popleft()
                self._bytes -= old.kv.nbytes
                self.dropped_blocks += len(old.hashes)

    def clear(self) -> None:
        """Drop what waits (a hot swap: the blocks of the version before are not sent)."""
        with self._lock:
            self.dropped_blocks += sum(len(item.hashes) for item in self._items)
            self._items.clear()
            self._bytes = 0

    def take(self) -> PublishedBlocks | None:
        with self._lock:
            if not self._items:
                return None
            item = self._items.popleft()
            self._bytes -= item.kv.nbytes
            return item
