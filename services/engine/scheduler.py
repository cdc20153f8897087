"""Which tokens run in the next step.  Pure CPU: no tensors, no clocks, no I/O.

Continuous batching: requests join and leave between steps.  Each step has a token
budget; running requests go first (a decode costs one token, an unfinished prefill takes
the next chunk), then waiting requests are admitted, interactive before batch, while
budget, sequence slots and KV blocks last.  When a running request needs a block and
none is free, the lowest-priority, most recently admitted request is preempted: its
blocks are freed and it waits again, to be recomputed from its prompt plus the tokens
it already produced (so nothing is lost and its output continues unchanged).

A request may arrive with staged blocks: prompt KV the server fetched from the shared cache.
At admission the staged blocks that continue the local prefix hit count as computed; the batch
lists them as (block id, KV) imports, which the engine copies in before the model runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from services.engine.block_manager import BlockManager, BlockTable
from services.engine.request import Request, RequestStatus, StagedBlock

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 512     # tokens per step: decode rows plus prefill chunks
    max_running: int = 64             # sequences per step
    watermark_blocks: int = 0         # free blocks kept back when admitting new requests

    def __post_init__(self) -> None:
        if self.max_batched_tokens < 1 or self.max_running < 1 or self.watermark_blocks < 0:
            raise ValueError("scheduler limits must be positive")


class Chunk(NamedTuple):
    request: Request
    start: int          # first position computed this step
    num_tokens: int     # positions start .. start+num_tokens-1
    sample: bool        # the chunk reaches the end of the request's tokens: sample the next one
    draft: int = 0      # of num_tokens, the last `draft` are request.draft's tokens, each row sampled


class Batch(NamedTuple):
    chunks: list[Chunk]
    preempted: list[Request]
    # (block id, (layers, 2, block_size, kv_heads, head_dim) KV): copy in before running the chunks
    imports: list[tuple[int, torch.Tensor]]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig | None = None):
        self.blocks = blocks
        self.config = config or SchedulerConfig()
        # One queue per priority class; index 0 (interactive) is served first.
        self.waiting: tuple[deque[Request], deque[Request]] = (deque(), deque())
        self.running: list[Request] = []
        self._arrivals = 0

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, request: Request) -> None:
        request.arrival = self._arrivals
        self._arrivals += 1
        request.status = RequestStatus.WAITING
        self.waiting[request.priority].append(request)

    def schedule(self) -> Batch:
        budget = self.config.max_batched_tokens
        chunks: list[Chunk] = []
        preempted: list[Request] = []
        imports: list[tuple[int, torch.Tensor]] = []
        self.running.sort(key=lambda r: (r.priority, r.arrival))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(len(req.all_ids) - req.num_computed, budget)
            target = req.num_computed + n
            # A decode row may carry its draft (speculate.py) when the budget and free blocks allow.
            draft = len(req.draft) if n == 1 and target == len(req.all_ids) and budget > len(req.draft) else 0
            if draft and not self.blocks.can_grow(req.table, target + draft):
                draft = 0
            while not self.blocks.can_grow(req.table, target):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req itself was preempted, and every request after it before that
            self.blocks.grow(req.table, target + draft)
            chunks.append(Chunk(req, req.num_computed, n + draft, target == len(req.all_ids), draft))
            budget -= n + draft
            i += 1
        if not preempted:
            self._admit(chunks, budget, imports)
        return Batch(chunks, preempted, imports)

    def _admit(self, chunks: list[Chunk], budget: int, imports: list[tuple[int, torch.Tensor]]) -> None:
        for queue in self.waiting:
            while queue and budget > 0 and len(self.running) < self.config.max_running:
                req = queue[0]
                tokens = req.all_ids
                if not self.blocks.can_allocate(tokens, reserve=self.config.watermark_blocks, salt=req.cache_salt):
                    return  # head-of-line: keep arrival order rather than starve big requests
                queue.popleft()
                req.table, cached = self.blocks.allocate(tokens, req.cache_salt)
                cached += self._import_staged(req, cached, imports)
                req.num_computed = cached
                req.num_cached_tokens = max(req.num_cached_tokens, min(cached, len(req.prompt_ids)))
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                n = min(len(tokens) - cached, budget)
                chunks.append(Chunk(req, cached, n, cached + n == len(tokens)))
                budget -= n

    def _import_staged(self, req: Request, cached: int, imports: list[tuple[int, torch.Tensor]]) -> int:
        """Count the staged blocks that continue the local hit as computed; returns their tokens.

        Only an unbroken run from the first block not cached here is usable, and only blocks whose
        hash is the one this request's tokens give (the prompt could differ from what was fetched
        for, e.g. resumed tokens).  Staged KV is dropped either way: a preempted request recomputes
        from (or hits) the local cache."""
        staged, req.staged = req.staged, []
        if not staged:
            return 0
        first = cached // self.blocks.block_size
        hashes = self.blocks.prefix_hashes(req.all_ids, req.cache_salt)
        take: list[StagedBlock] = []
        for block in staged:
            i = first + len(take)
            if block.position < i:
                continue                # cached here since it was fetched
            if block.position != i or i >= len(hashes) or block.hash != hashes[i]:
                break
            take.append(block)
        ids = self.blocks.register_imported(req.table, [b.hash for b in take])
        imports.extend(zip(ids, (b.kv for b in take), strict=True))
        return len(take) * self.blocks.block_size

    def commit(self, batch: Batch) -> None:
        """After the model ran: the chunks' KV is in the cache; register full blocks."""
        for chunk in batch.chunks:
            req = chunk.request
            # Draft rows' KV counts once their tokens are accepted (Engine._accept).
            req.num_computed = chunk.start + chunk.num_tokens - chunk.draft
            self.blocks.commit(req.table, req.all_ids, req.num_computed)

    def finish(self, request: Request) -> None:
        """Remove a request wherever it is and release its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting[request.priority].remove(request)
        self.blocks.free_table(request.table)
        request.status = RequestStatus.FINISHED

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free_table(request.table)
        request.table = BlockTable()
        request.num_computed = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting[request.priority].appendleft(request)
