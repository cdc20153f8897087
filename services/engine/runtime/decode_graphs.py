"""Pure-decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model on a GPU is a few hundred short kernels; launched one by one
from Python they cost more than they compute.  Captured once per bucket size (1, 2, 4, 8, 16,
24, 32, ... up to the engine's --max-running), a step becomes: copy the step's integers into
static device buffers, replay the bucket's graph, read the sampled ids back.

The buffers are sized for the largest bucket and the longest context (a block table row holds
max_context / block_size entries; a row reads only the entries its length needs).  Rows past
the step's batch, up to its bucket, are padding: token 0 at position 0, writing its K/V to the
runner's scratch block and attending that one slot, so they can never touch a real request's
blocks.  All the padding is rewritten every step from the one host copy.

capture=False runs the same buffers and padding without capturing (the graphs' logic, which
the CPU tests exercise); capture=True records the graphs at construction, largest first, in
one shared memory pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from meshkernels import paged_attention
from services.engine.runtime.kv_transfer import int64_parts
from services.engine.runtime.models.attention import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class DecodeModel(Protocol):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: list[tuple[torch.Tensor, torch.Tensor]], logits_rows: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @property
    def needs_decode_mask(self) -> bool: ...


def padded_tables(tables: Sequence[Sequence[int]], width: int) -> list[int]:
    """Block tables as one flat (len(tables) x width) row-major list, each row padded by repeating its
    first block (any valid id: a row reads only the entries its length needs)."""
    return [b for t in tables for b in (*t, *(t[0],) * (width - len(t)))]


def buckets(max_batch: int) -> list[int]:
    """The batch sizes captured for an engine running at most max_batch sequences (max_batch included)."""
    sizes = [b for b in BUCKETS if b < max_batch]
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_context: int, scratch_block: int, max_batch: int, device: torch.device, capture: bool):
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.model: DecodeModel = model
        self.kv = kv
        self.block_size = block_size
        self.sizes = buckets(max_batch)
        self.max_batch = self.sizes[-1]
        self.width = -(-max_context // block_size)       # table entries for the longest context
        self.scratch_block = scratch_block
        self.device = device
        b = self.max_batch

        def buffer(fill: int, *shape: int) -> torch.Tensor:
            return torch.full(shape or (b,), fill, dtype=torch.int64, device=device)

        self.ids = buffer(0)
        self.positions = buffer(0)
        self.slots = buffer(scratch_block * block_size)
        self.lens = buffer(1)
        self.tables = buffer(scratch_block, b, self.width)
        self.rows = torch.arange(b, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # bucket -> (logits, tokens)
        self.replays = 0
        if capture:
            self._capture()

    def bucket(self, n: int) -> int:
        """The smallest captured size that holds n rows."""
        for size in self.sizes:
            if size >= n:
                return size
        raise ValueError(f"a decode batch of {n} rows is over the largest bucket ({self.max_batch})")

    @torch.inference_mode()
    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model on the first `size` rows of the static buffers: (logits (size, V) float32, argmax ids)."""
        tables, lens = self.tables[:size], self.lens[:size]
        mask = None
        if self.model.needs_decode_mask:
            mask = paged_attention.decode_mask(tables, lens, self.block_size, self.kv[0][0].dtype)
        meta = AttentionMetadata(slots=self.slots[:size], decode_rows=self.rows[:size], decode_tables=tables,
                                 decode_lens=lens, decode_mask=mask, prefills=())
        hidden = self.model.forward(self.ids[:size], self.positions[:size], meta, self.kv, self.rows[:size])
        logits = self.model.logits(hidden)
        return logits, logits.argmax(dim=-1)

    def _capture(self) -> None:
        """Record one graph per bucket, largest first, all in one memory pool (each replay reuses it)."""
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)               # warm up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def _load(self, size: int, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
              tables: Sequence[Sequence[int]]) -> None:
        """One host-to-device copy of the step's integers, padding included, then device-side copies
        into the static buffers (those are what the graphs read)."""
        n = len(ids)
        pad = size - n
        width = max(len(t) for t in tables)
        flat_tables = padded_tables(tables, width) + [self.scratch_block] * (pad * width)
        d_ids, d_positions, d_slots, d_lens, d_tables = int64_parts(
            self.device, [*ids, *(0,) * pad], [*positions, *(0,) * pad],
            [*slots, *(self.scratch_block * self.block_size,) * pad], [*(p + 1 for p in positions), *(1,) * pad],
            flat_tables)
        self.ids[:size].copy_(d_ids)
        self.positions[:size].copy_(d_positions)
        self.slots[:size].copy_(d_slots)
        self.lens[:size].copy_(d_lens)
        self.tables[:size, :width].copy_(d_tables.view(size, width))

    def launch(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
               tables: Sequence[Sequence[int]], greedy: bool) -> torch.Tensor:
        """Queue one decode step for len(ids) rows: (n,) token ids with greedy, else (n, V) float32 logits,
        on the device (views of the graph's outputs: read them before the next step)."""
        n = len(ids)
        size = self.bucket(n)
        self._load(size, ids, positions, slots, tables)
        if size in self.graphs:
            self.graphs[size].replay()
            logits, tokens = self.outputs[size]
        else:
            logits, tokens = self._forward(size)
        self.replays += 1
        return tokens[:n] if greedy else logits[:n]
