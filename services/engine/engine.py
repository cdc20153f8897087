"""The engine: add / abort / step.  One step is schedule -> run the model -> update.

The scheduler picks the step's chunks (proposing drafts first, with speculation on), the model runs them
and the sampler turns its rows into tokens in one call (sampler.sample_rows: penalties, grammar masks,
sampling), and update.py takes those tokens into the requests; every request ends in one place (_finish).

add() and abort() are called from the event loop while step() runs in a worker thread: they only append to
thread-safe inboxes, which step() drains, so the scheduler and the block manager are touched by one thread
only.  What a step measures is kept in `stats` (services/engine/stats.py).  add() refuses a request the
waiting room has no place for (fairness.waiting_refusal: a flooding tenant leaves the others a quarter).

With a shared KV cache, running a batch also copies in the KV the scheduler imported (fetched by the server
before add) and, after the model ran, copies out the prompt blocks it just computed into `outbox`, which the
server's publisher drains.

A step that raises (a model failure) leaves the engine usable: the server calls fail_step(), which ends the
requests of the batch that step was running with FinishReason.ERROR; the requests the step did not touch
(waiting for admission, or left out of the batch) go on.

With speculation on (services/engine/core/speculate.py), a step may verify draft tokens of its decode
rows: a request's step output then carries every token the step accepted, in order.  The drafts come from
each request's own text (prompt lookup), or from a draft model (runtime/draft_model.py: `draft`), whose
sampled tokens are kept or replaced by speculative sampling's rule (runtime/draft_verify.py); a drafted
step's speed-up against a plain one is measured, and drafting stops where it does not pay (DraftGain).

A step of batch-class rows only gives way to an interactive request that arrives while it runs: the model
stops between layers and the step counts as not run (models/interrupt.py).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Sequence

import torch

from mesh.errors import ResourceExhausted
from services.engine.core.admission import build_request
from services.engine.core.block_manager import BlockManager
from services.engine.core.fairness import waiting_refusal
from services.engine.core.request import (
    COMMON,
    EngineTokenLogprob,
    FinishReason,
    Owner,
    Request,
    SamplingParams,
    StepOutput,
)
from services.engine.core.scheduler import Batch, Scheduler, SchedulerConfig
from services.engine.core.speculate import SpeculationConfig
from services.engine.core.update import Rules, update_from_output
from services.engine.runtime import draft_verify, grammar, kv_transfer, sampler
from services.engine.runtime.adapters import AdapterPool, factor_dtype, shape_of
from services.engine.runtime.draft_model import DraftModel
from services.engine.runtime.grammar_limits import GrammarLimits
from services.engine.runtime.kv_transfer import Outbox
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.models.interrupt import interruptible
from services.engine.runtime.versions import Versions
from services.engine.stats import EngineStats, Timing


class Engine:
    def __init__(self, runner: ModelRunner, max_waiting: int = 256, scheduler: SchedulerConfig | None = None,
                 outbox: Outbox | None = None, speculation: SpeculationConfig | None = None, version: str = "1",
                 grammar_limits: GrammarLimits | None = None, draft: DraftModel | None = None):
        self.runner = runner
        self.draft = draft              # a draft model proposing the speculation's tokens; None: prompt lookup
        self.versions = Versions(runner, version)      # hot swaps (services/engine/runtime/versions.py)
        self.adapters = AdapterPool(shape_of(runner), factor_dtype(runner))   # LoRA (runtime/adapters.py)
        self.speculation = speculation or SpeculationConfig(max_draft=0)   # default: no drafts
        self.max_waiting = max_waiting
        self.outbox = outbox            # computed prompt blocks for the shared cache; None: no shared cache
        self.blocks = BlockManager(runner.num_blocks, runner.block_size)
        self.scheduler = Scheduler(self.blocks, scheduler, self.speculation, runner.max_context,
                                   proposer=draft.propose if draft is not None else None)
        self.rules = Rules(runner.eos_token_ids, runner.max_context, self.speculation.max_draft)   # update.py
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._requests: dict[str, Request] = {}
        self._batch: Batch | None = None        # the batch of the step being run (fail_step's victims)
        self._pending: list[StepOutput] = []    # that step's outputs so far (aborts), for fail_step
        self._lock = threading.Lock()
        self._give_way: threading.Event | None = None   # set when an interactive request comes in a batch-only step
        self.stats = EngineStats(self.scheduler.step_times)
        self.grammars = grammar.Grammars(runner.folder, runner.vocab_size, runner.eos_token_ids, grammar_limits)

    # -- admission ---------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     resume_ids: list[int] | None = None, owner: Owner = COMMON, cache_salt: bytes = b"",
                     cache_class: str = "", adapter: str = "") -> Request:
        """Validate a request against the model's and the KV cache's limits (a precise error if it
        breaks one); it runs on the active model version (and LoRA `adapter`, if named) to its end."""
        req = build_request(self.runner, self.blocks, request_id, prompt_ids, sampling, resume_ids, owner, cache_salt)
        self.adapters.attach(req, adapter)
        self.versions.hold(req)
        req.cache_salt += self.versions.salt(req.version)
        req.cache_class = cache_class
        return req

    def add(self, request: Request) -> None:
        with self._lock:
            queued = [*self._inbox, *self.scheduler.waiting[0], *self.scheduler.waiting[1]]
            refused = waiting_refusal(Counter(r.tenant for r in queued), request.tenant, self.max_waiting)
            if refused:
                raise ResourceExhausted(refused)
            self.stats.arrived(request.request_id)
            self._inbox.append(request)
            if request.priority == 0 and self._give_way is not None:
                self._give_way.set()

    def uncached_prefix(self, tokens: Sequence[int], salt: bytes = b"") -> tuple[int, list[bytes]]:
        """(i, hashes): the chained hashes of the usable prompt blocks from block i, the first not cached
        here.  Read-only, for the server's thread: a stale answer costs only a block fetched in vain."""
        hashes = self.blocks.prefix_hashes(tokens, salt)
        cached = self.blocks.cached
        i = 0
        while i < len(hashes) and hashes[i] in cached:
            i += 1
        return i, hashes[i:]

    def pop_timing(self, request_id: str) -> Timing | None:
        """The request's phase timings (once: the entry is dropped)."""
        return self.stats.pop_timing(request_id)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self._requests or any(r.request_id == request_id for r in self._inbox)
            self._aborts.append(request_id)
        return known

    def has_work(self) -> bool:
        return bool(self._inbox) or bool(self._aborts) or self.scheduler.has_work()

    def run_until_idle(self) -> dict[str, list[StepOutput]]:
        """Step until every request has ended, for callers in-process (tests, benches; the server steps in its
        own loop): each request's outputs in order."""
        outputs: dict[str, list[StepOutput]] = {}
        while self.has_work():
            for out in self.step():
                outputs.setdefault(out.request_id, []).append(out)
        return outputs

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """schedule -> run the model -> update: each running request's new tokens, or its end."""
        self._switch_version()
        self._pending = self._drain()           # arrivals in the scheduler, aborts ended: their outputs
        self._batch = batch = self.scheduler.schedule(arriving=bool(self._inbox))
        drafted, accepted = self.stats.draft_tokens, self.stats.accepted_tokens
        with self._giving_way(batch), self.stats.step(batch):
            if batch.chunks:
                self._pending += self._update(batch, self._run(batch))
        self._measure_draft(batch, self.stats.draft_tokens - drafted, self.stats.accepted_tokens - accepted)
        return self._end_step()

    def fail_step(self) -> list[StepOutput]:
        """After step() raised: end the requests of the batch it was running with FinishReason.ERROR (the
        server fails their calls; the model may have left them half-computed) and keep the others.  The
        step's other outputs (aborts) are returned too.  A failure before a batch was scheduled fails
        every request (fail_all)."""
        batch, self._batch, self._give_way = self._batch, None, None
        outputs, self._pending = self._pending, []
        if batch is None:
            return outputs + self.fail_all()
        victims = {c.request.request_id: c.request for c in batch.chunks}
        return outputs + [self._finish(req, FinishReason.ERROR) for rid, req in victims.items()
                          if rid in self._requests]

    def fail_all(self) -> list[StepOutput]:
        """After a model failure: end every request the engine holds with FinishReason.ERROR (the server
        fails their calls) and keep serving.  The failed step may have left any of them half-computed."""
        return [self._finish(req, FinishReason.ERROR) for req in list(self._requests.values())]

    def _drain(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        with self._lock:
            while self._inbox:
                req = self._inbox.popleft()
                self._requests[req.request_id] = req
                self.scheduler.add(req)
            aborts = list(self._aborts)
            self._aborts.clear()
        for request_id in aborts:
            aborted = self._requests.get(request_id)
            if aborted is not None:
                outputs.append(self._finish(aborted, FinishReason.ABORT))
        return outputs

    def _switch_version(self) -> None:
        """A hot swap takes effect between steps (versions.py)."""
        if self.versions.switch() and self.outbox is not None:
            self.outbox.clear()            # blocks of the version before: published under its name, or not at all

    def _giving_way(self, batch: Batch) -> interruptible:
        """Around a step's run: one of batch-class rows only stops between layers when an interactive
        request arrives (add() sets the event), and counts as not run: the next step takes its rows again."""
        with self._lock:
            self._give_way = threading.Event() if batch.batch_class else None
            if self._give_way is not None and any(r.priority == 0 for r in self._inbox):
                self._give_way.set()
        return interruptible(self._give_way, self.stats.gave_way)

    def _end_step(self) -> list[StepOutput]:
        """The step's outputs, once it is over: the tenants' figures after it, an unused old version released."""
        outputs, self._batch, self._pending, self._give_way = self._pending, None, [], None
        self.stats.observe_tenants(self.scheduler.tenant_counts())
        if len(self.versions.models) > 1:
            self.versions.release_unused()
        return outputs

    def _run(self, batch: Batch) -> torch.Tensor:
        """The model on the batch: (S, V) logits of its sampled rows, or (S,) token ids if all are greedy."""
        kv_transfer.import_blocks(self.runner.kv, batch.imports)     # what the shared cache had for them
        logits = self.versions.run(batch.chunks, greedy=batch.greedy)
        self.scheduler.commit(batch)
        self._publish(batch)
        return logits

    def _publish(self, batch: Batch) -> None:
        """Copy out the prompt blocks this step filled (after commit registered them) for the shared cache.

        Local hits and imports are never in a chunk, so they are not sent back; a block that merely
        duplicates one another request registered first is skipped too."""
        if self.outbox is None:
            return
        bs = self.blocks.block_size
        ids: list[int] = []
        hashes: list[bytes] = []
        classes: list[str] = []
        for chunk in batch.chunks:
            req = chunk.request
            if req.sampling.prompt_logprobs or req.sampling.pooling or req.version != self.versions.active:
                continue            # a namespace of its own (make_request), or a version on its way out
            end = min(chunk.start + chunk.num_tokens, len(req.prompt_ids) + len(req.resume_ids))
            for i in range(chunk.start // bs, end // bs):
                block, h = req.table.blocks[i], req.table.hashes[i]
                if self.blocks.block_hash[block] == h:
                    ids.append(block)
                    hashes.append(h)
                    classes.append(req.cache_class)
        if ids:
            exported = kv_transfer.export_blocks_async(self.runner.kv, ids)   # the publisher waits for it
            self.outbox.put(hashes, exported.kv, exported.ready, version=self.versions.active, classes=classes)

    def _update(self, batch: Batch, logits: torch.Tensor) -> list[StepOutput]:
        """logits: (S, V), or (S,) token ids when every sampled row was greedy; a chunk with drafts has
        1 + draft rows (Batch.rows).  The rows sampled in one call, the tokens taken into the requests
        (update.py); a request that ends ends in _finish."""
        tokens = sampler.sample_rows(logits, batch.rows, self.rules.eos_token_ids)
        if self.draft is not None and logits.dim() == 2:
            _verify_drafts(batch, logits, tokens)
        step = update_from_output(batch, tokens, logits, self.rules, self.blocks, self._finish)
        self.stats.drafted(step.drafted, step.accepted)
        return step.outputs

    def _measure_draft(self, batch: Batch, drafted: int, accepted: int) -> None:
        """A step that verified a draft model's tokens: its speed-up against a plain step of its size, the
        draft's passes included (DraftGain: where drafting goes on)."""
        if self.draft is None or not drafted:
            return
        sampled = sum(c.sample for c in batch.chunks)
        gain = self.scheduler.gain
        gain.record(sampled, self.draft.seconds + self.stats.last_step_s, sampled + accepted)
        self.stats.draft_speedup = gain.last

    def _finish(self, req: Request, reason: FinishReason, tokens: tuple[int, ...] = (),
                logprobs: tuple[EngineTokenLogprob, ...] = (), prompt: tuple[EngineTokenLogprob, ...] = ()
                ) -> StepOutput:
        """Where every request ends (update.py's stops and lengths, aborts, failures): out of the scheduler
        and the engine, its last output with its totals."""
        self.scheduler.finish(req)
        self._requests.pop(req.request_id, None)
        if self.draft is not None:
            self.draft.release(req.request_id)
        req.finish_reason = reason
        self.stats.finished(req.request_id)
        return StepOutput(req.request_id, tokens, logprobs, reason,
                          prompt_tokens=len(req.prompt_ids), completion_tokens=req.num_generated,
                          cached_tokens=req.num_cached_tokens, prompt_logprobs=prompt,
                          embedding=req.embedding() if reason is not FinishReason.ERROR else ())


def _verify_drafts(batch: Batch, logits: torch.Tensor, tokens: list[int]) -> None:
    """A draft model's sampled drafts, kept or replaced by speculative sampling's rule (draft_verify.verify) in
    `tokens` (sample_rows' plain draws for their rows are dropped): the kept drafts, then the residual's or
    the bonus token, so that update_from_output, which takes tokens while they equal the drafts, takes
    exactly those.  A greedy request's drafts need no rule: its argmax equals a draft or it does not."""
    row = 0
    for chunk in batch.chunks:
        if not chunk.sample:
            continue
        req = chunk.request
        if chunk.draft and req.draft_q is not None:
            rows = 1 + chunk.draft
            p = sampler.distributions(logits[row:row + rows], [req.sampling] * rows)
            kept = draft_verify.verify(req.draft[:chunk.draft], req.draft_q[:chunk.draft], p, req.sampling.seed,
                                       req.num_generated)
            tokens[row:row + len(kept)] = kept
        row += 1 + chunk.draft
