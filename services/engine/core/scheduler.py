"""Which tokens run in the next step.  Pure CPU: no tensors, no clocks, no I/O.

Continuous batching: requests join and leave between steps.  Each step has a token
budget and sequence slots (its rows).  Interactive requests go before batch ones; within a
class, weighted fair queuing between tenants (fairness.py): the tenant with the lowest
virtual time (tokens served / its weight) goes next, and within a tenant its running
requests (a decode costs one token, an unfinished prefill takes the next chunk) go before
its waiting ones, in arrival order.  So a tenant with many streams gets the rows its share
allows and another tenant's single request runs at once.  While such a light tenant is
active, a step's rows are also capped (fairness.row_cap, from the decode step times the engine
measured) so that its steps are not slowed more than `fair_slowdown` times below its share.
A running request left out of a step (its tenant's share spent, or a higher class took its row)
keeps its KV blocks.
`fair=False` puts every request in one tenant: first come, first served within a class.

When a running request needs a block and none is free, the running requests not taken this
step are preempted, last-ranked first (batch class, most served tenant, newest), then the
request itself: their blocks are freed and they wait again, to be recomputed from the prompt
plus the tokens already produced (nothing is lost and the output continues unchanged).  An
interactive request waiting for blocks may likewise preempt batch-class requests not taken.

A request may arrive with staged blocks: prompt KV the server fetched from the shared cache.
At admission the staged blocks that continue the local prefix hit count as computed; the batch
lists them as (block id, KV) imports, which the engine copies in before the model runs.

With speculation on (speculate.py), scheduling first proposes drafts for the decode rows, while every
running request decodes and none waits; a decode row then carries its draft (Chunk.draft) when the
budget and the free blocks allow.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from services.engine.core.block_manager import BlockManager, BlockTable
from services.engine.core.fairness import StepTimes, TenantClocks, check_slowdown, row_cap
from services.engine.core.request import Request, RequestStatus, StagedBlock
from services.engine.core.speculate import DraftGain, Lookup, SpeculationConfig

# A draft model's proposals (runtime/draft_model.py): (request, up to k tokens) -> each request's drafts.
Proposer = Callable[[Sequence[tuple[Request, int]]], list[list[int]]]

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 512     # tokens per step: decode rows plus prefill chunks
    max_running: int = 64             # sequences per step
    watermark_blocks: int = 0         # free blocks kept back when admitting new requests
    fair: bool = True                 # weighted fair queuing between tenants; False: one queue per class
    # A running request left out of this many steps in a row goes first (a stream never stalls for long,
    # whatever the weights: the router takes ~10 s of silence for a dead engine).
    max_paused_steps: int = 32
    # With fair queuing, a step's rows are capped so that no light tenant (one whose requests all fit in its share
    # of the rows) decodes more than this many times slower than its share of the engine (fairness.row_cap,
    # from the decode step times measured); 0: no cap (fair queuing only: the most tokens per step).
    fair_slowdown: float = 1.5

    def __post_init__(self) -> None:
        if min(self.max_batched_tokens, self.max_running, self.max_paused_steps) < 1 or self.watermark_blocks < 0:
            raise ValueError("scheduler limits must be positive")
        check_slowdown(self.fair_slowdown)


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
    paused: int = 0     # running requests this step left out (their tenant's share spent, or a higher class)
    capped: bool = False    # the row cap for light tenants (fairness.row_cap) left requests out of this step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def rows(self) -> list[tuple[Request, int]]:
        """The rows the model's output holds, in order, as (request, i): each sampled chunk's token at its
        request's next position (i 0), then one row per draft token it verifies (i 1..draft)."""
        return [(c.request, i) for c in self.chunks if c.sample for i in range(1 + c.draft)]

    @property
    def greedy(self) -> bool:
        """Every sampled row takes the argmax of unprocessed logits and wants no logprobs: the model may
        return token ids instead of logits."""
        sampled = [c.request.sampling for c in self.chunks if c.sample]
        return all(p.greedy and not p.logprobs and not p.processed for p in sampled)

    @property
    def batch_class(self) -> bool:
        """Only batch-class rows: such a step gives way to an interactive arrival (models/interrupt.py)."""
        return bool(self.chunks) and all(c.request.priority > 0 for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig | None = None,
                 speculation: SpeculationConfig | None = None, max_context: int = 0, proposer: Proposer | None = None):
        self.blocks = blocks
        self.config = config or SchedulerConfig()
        self.speculation = speculation or SpeculationConfig(max_draft=0)     # default: no drafts
        self.proposer = proposer                 # a draft model's (runtime/draft_model.py); None: prompt lookup
        self.max_context = max_context           # the model's: drafts stay within it
        self._drafted: list[Request] = []        # requests given a draft for the step scheduled last
        # One queue per priority class; index 0 (interactive) is served first.
        self.waiting: tuple[deque[Request], deque[Request]] = (deque(), deque())
        self.running: list[Request] = []       # requests holding KV blocks (a step takes some or all)
        self.clocks = TenantClocks()
        self.step_times = StepTimes()            # the engine records its decode steps' times (row_cap reads them)
        self.gain = DraftGain(self.step_times)   # with a draft model: where drafting pays, as measured
        self.steps = 0                           # schedule() calls so far
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
        self.clocks.arrive(self._tenant(request), request.weight if self.config.fair else 1.0)

    def schedule(self, arriving: bool = False) -> Batch:
        """This step's chunks.  Candidates (each tenant's running requests, least recently served first, then
        its waiting ones in queue order: _candidates) are taken class by class, and within a class from the
        tenant with the lowest virtual time (fairness.py; the step's own chunks count as they are taken),
        while the token budget and the sequence slots last (`max_running`, fewer while a light tenant is active:
        fairness.row_cap).  A running request not taken this step keeps its
        KV blocks (paused).  A step that prefills an interactive request takes no batch-class rows: its first
        token comes as soon as it would on an idle engine.  With speculation on, drafts are proposed first
        (_propose); `arriving` (a request is on its way in, not yet added) holds them back."""
        if self.speculation.max_draft:
            self._propose(arriving)
        self.steps += 1
        chunks: list[Chunk] = []
        preempted: list[Request] = []
        imports: list[tuple[int, torch.Tensor]] = []
        queues = self._candidates()
        cap = self._row_cap(queues)
        budget, slots = self.config.max_batched_tokens, cap
        projected = {key[1]: self.clocks.vtime.get(key[1], 0.0) for key in queues}
        heap = [(key[0], projected[key[1]], q[0].arrival, key) for key, q in queues.items()]
        heapq.heapify(heap)
        untaken = {id(r): r for r in self.running}
        blocked: set[str] = set()    # tenants whose next request could not be admitted (no blocks)
        short = False                # a running request lacked blocks: no admission this step
        prefilling = False           # an interactive request's prompt runs in this step
        while heap and budget > 0 and slots > 0:
            _, _, _, key = heapq.heappop(heap)
            if key[0] > 0 and prefilling:
                break                # batch-class rows wait a step (they come after every interactive one)
            queue = queues[key]
            req = queue.popleft()
            if req.status is RequestStatus.RUNNING:
                del untaken[id(req)]
                before = len(preempted)
                n = self._continue(req, budget, chunks, preempted, untaken)
                if not n:
                    break            # it preempted itself: no running request is left to take
                short = short or len(preempted) > before
            elif short or req in preempted or not (n := self._admit(req, budget, chunks, imports, untaken,
                                                                      preempted)):
                queue.clear()        # head of line: the tenant's later requests wait behind it
                blocked.add(key[1])
                continue
            budget, slots = budget - n, slots - 1
            projected[key[1]] += self.clocks.cost(key[1], n)
            prompt = len(req.prompt_ids) + len(req.resume_ids)
            prefilling = prefilling or (req.priority == 0 and chunks[-1].start < prompt)
            if queue:
                heapq.heappush(heap, (key[0], projected[key[1]], queue[0].arrival, key))
        self.clocks.keep_up(blocked | {key[1] for key, queue in queues.items() if queue})
        capped = cap < self.config.max_running and not slots and bool(heap)
        return Batch(chunks, preempted, imports, len(untaken), capped)

    def _propose(self, arriving: bool) -> None:
        """Drafts (Request.draft) for this step's decode rows, interactive then batch class, oldest first, while
        the step stays within the row budget (`max_rows`): each request's speculate.Lookup, or with a draft
        model (`proposer`) its tokens for all of them in one call, each request asking for its adaptive length.

        Only when every running request is decoding and none waits: a step that admits or prefills is not
        bound by reading the weights, and a waiting request's first token matters more.  A row whose logits
        are processed (penalties, a grammar) gets none: it needs its own history at every position.  With a
        draft model, only at the batch sizes where drafting was measured to pay (`gain`)."""
        for req in self._drafted:
            req.draft, req.draft_q = [], None
        self._drafted = []
        spec = self.speculation
        spare = spec.max_rows - len(self.running)
        if spare <= 0 or self.num_waiting or arriving:
            return
        if any(r.num_computed != len(r.all_ids) - 1 for r in self.running):
            return
        if self.proposer is not None and spec.measure and not self.gain.allowed(len(self.running)):
            return
        asked: list[tuple[Request, int]] = []
        for req in sorted(self.running, key=lambda r: (r.priority, r.arrival)):
            if req.lookup is None:
                req.lookup = Lookup(spec.min_ngram, spec.max_ngram, draft_len=spec.max_draft)
            # Every accepted draft and the token after them must fit max_tokens and the context.
            room = min(req.max_tokens - req.num_generated, self.max_context - len(req.all_ids)) - 1
            k = min(req.lookup.draft_len, spare, room) if not req.sampling.processed else 0
            if k <= 0:
                continue
            if self.proposer is not None:
                asked.append((req, k))
                spare -= k
            else:
                req.draft = req.lookup.propose(req.all_ids, k)
                if req.draft:
                    self._drafted.append(req)
                    spare -= len(req.draft)
            if spare <= 0:
                break
        if asked and self.proposer is not None:
            for (req, _), draft in zip(asked, self.proposer(asked), strict=True):
                req.draft = draft
                self._drafted.append(req)

    def _candidates(self) -> dict[tuple[int, str], deque[Request]]:
        """(class, tenant) -> its running requests, least recently served first (so a tenant's streams take
        turns when its share holds fewer rows than it has streams), then its waiting ones in queue order.
        A running request left out for more than `max_paused_steps` goes in class -1: before every other."""
        queues: dict[tuple[int, str], deque[Request]] = {}
        for req in sorted(self.running, key=lambda r: (r.served, r.arrival)):
            overdue = self.steps - req.served > self.config.max_paused_steps
            queues.setdefault((-1 if overdue else req.priority, self._tenant(req)), deque()).append(req)
        for queue in self.waiting:
            for req in queue:
                queues.setdefault((req.priority, self._tenant(req)), deque()).append(req)
        return queues

    def _row_cap(self, queues: dict[tuple[int, str], deque[Request]]) -> int:
        """The rows this step may take: `max_running`, or fewer while a light tenant is active (row_cap)."""
        if not self.config.fair or not self.config.fair_slowdown:
            return self.config.max_running
        demand: dict[str, int] = {}
        for (_, tenant), queue in queues.items():
            if n := sum(r.priority == 0 for r in queue):
                demand[tenant] = demand.get(tenant, 0) + n
        weights = {key[1]: self.clocks.weight.get(key[1], 1.0) for key in queues}
        return row_cap(self.config.max_running, demand, weights, self.step_times, self.config.fair_slowdown)

    def tenant_counts(self) -> dict[str, tuple[int, int]]:
        """tenant -> (its running requests, its waiting ones)."""
        counts: dict[str, tuple[int, int]] = {}
        for req in self.running:
            running, waiting = counts.get(req.tenant, (0, 0))
            counts[req.tenant] = (running + 1, waiting)
        for queue in self.waiting:
            for req in queue:
                running, waiting = counts.get(req.tenant, (0, 0))
                counts[req.tenant] = (running, waiting + 1)
        return counts

    def _tenant(self, req: Request) -> str:
        return req.tenant if self.config.fair else ""

    def _worst(self, requests: dict[int, Request]) -> Request:
        """The request that ranks last: lowest class, then highest virtual time, then newest."""
        return max(requests.values(), key=lambda r: (r.priority, self.clocks.vtime.get(self._tenant(r), 0.0),
                                                    r.arrival))

    def _continue(self, req: Request, budget: int, chunks: list[Chunk], preempted: list[Request],
                  untaken: dict[int, Request]) -> int:
        """A running request's next chunk (its decode row, with its draft when budget and blocks allow,
        or its prefill's next piece).  Without a free block, the running requests not yet taken this
        step are preempted, last-ranked first, then the request itself.  Returns its tokens (0: preempted)."""
        n = min(len(req.all_ids) - req.num_computed, budget)
        target = req.num_computed + n
        # A decode row may carry its draft (speculate.py) when the budget and free blocks allow.
        draft = len(req.draft) if n == 1 and target == len(req.all_ids) and budget > len(req.draft) else 0
        if draft and not self.blocks.can_grow(req.table, target + draft):
            draft = 0
        while not self.blocks.can_grow(req.table, target):
            victim = self._worst(untaken) if untaken else req
            untaken.pop(id(victim), None)
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return 0
        self.blocks.grow(req.table, target + draft)
        chunks.append(Chunk(req, req.num_computed, n + draft, target == len(req.all_ids), draft))
        req.served = self.steps
        return n + draft

    def _admit(self, req: Request, budget: int, chunks: list[Chunk], imports: list[tuple[int, torch.Tensor]],
               untaken: dict[int, Request], preempted: list[Request]) -> int:
        """A waiting request's admission and first chunk; 0 when its blocks are not there.  An interactive
        request may take the blocks of batch-class requests not taken this step (they are preempted)."""
        tokens = req.all_ids
        reserve = self.config.watermark_blocks
        while not self.blocks.can_allocate(tokens, reserve=reserve, salt=req.cache_salt):
            lower = {k: r for k, r in untaken.items() if r.priority > req.priority}
            if not lower:
                return 0
            victim = self._worst(lower)
            del untaken[id(victim)]
            self._preempt(victim)
            preempted.append(victim)
        self.waiting[req.priority].remove(req)
        req.table, cached = self.blocks.allocate(tokens, req.cache_salt)
        cached += self._import_staged(req, cached, imports)
        req.num_computed = cached
        req.num_cached_tokens = max(req.num_cached_tokens, min(cached, len(req.prompt_ids)))
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        n = min(len(tokens) - cached, budget)
        chunks.append(Chunk(req, cached, n, cached + n == len(tokens)))
        req.served = self.steps
        return n

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
            # Draft rows' KV counts once their tokens are accepted (update.keep_drafts).
            req.num_computed = chunk.start + chunk.num_tokens - chunk.draft
            self.blocks.commit(req.table, req.all_ids, req.num_computed)
            self.clocks.charge(self._tenant(req), chunk.num_tokens)

    def finish(self, request: Request) -> None:
        """Remove a request wherever it is and release its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting[request.priority].remove(request)
        else:
            return                             # finished before
        self.blocks.free_table(request.table)
        request.status = RequestStatus.FINISHED
        self.clocks.leave(self._tenant(request))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free_table(request.table)
        request.table = BlockTable()
        request.num_computed = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting[request.priority].appendleft(request)
