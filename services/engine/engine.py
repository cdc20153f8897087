"""The engine: add / abort / step.  One step is schedule -> run the model -> postprocess.

add() and abort() are called from the event loop while step() runs in a worker thread:
they only append to thread-safe inboxes, which step() drains, so the scheduler and the
block manager are touched by one thread only.

With a shared KV cache, step() also copies in the KV the scheduler imported (fetched by the
server before add) and, after the model ran, copies out the prompt blocks it just computed
into `outbox`, which the server's publisher drains.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mesh.errors import InvalidArgument, ResourceExhausted
from services.engine import kv_transfer, sampler
from services.engine.block_manager import BlockManager
from services.engine.kv_transfer import Outbox
from services.engine.model_runner import ModelRunner
from services.engine.request import (
    FinishReason,
    Request,
    SamplingParams,
    StepOutput,
    TokenLogprob,
)
from services.engine.scheduler import Batch, Scheduler, SchedulerConfig

# Timings kept for requests whose server never collects them (in-process callers): the oldest go first.
MAX_TIMINGS = 4096


@dataclass
class Timing:
    """Wall-clock readings (time.time_ns()) of one request's phases, for its trace spans; 0: not yet.

    queue: arrival -> scheduled; prefill: scheduled -> first_token; decode: first_token -> finished.
    Written by the step thread, read by the server once the request is over (pop_timing)."""

    arrival_ns: int = 0
    scheduled_ns: int = 0          # the first step that ran any of its tokens began
    first_token_ns: int = 0        # the step that sampled its first token ended
    finished_ns: int = 0



class Engine:
    def __init__(self, runner: ModelRunner, max_waiting: int = 256, scheduler: SchedulerConfig | None = None,
                 outbox: Outbox | None = None):
        self.runner = runner
        self.max_waiting = max_waiting
        self.outbox = outbox            # computed prompt blocks for the shared cache; None: no shared cache
        self.blocks = BlockManager(runner.num_blocks, runner.block_size)
        self.scheduler = Scheduler(self.blocks, scheduler)
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._requests: dict[str, Request] = {}
        self._lock = threading.Lock()
        self.last_step_s = 0.0
        self.last_step_tokens = 0
        self.last_batch_size = 0
        self.preemptions = 0
        self._timings: dict[str, Timing] = {}

    # -- admission ---------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     resume_ids: list[int] | None = None, priority: int = 0) -> Request:
        """Validate a request against the model's and the KV cache's limits; raise a precise error."""
        resume = list(resume_ids or [])
        limit = self.runner.max_context
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty")
        bad = next((i for i in prompt_ids + resume if not 0 <= i < self.runner.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary (size {self.runner.vocab_size})")
        context = len(prompt_ids) + len(resume)
        if context >= limit:
            raise InvalidArgument(
                f"the prompt has {context} tokens but the model's context is {limit} tokens; shorten the prompt")
        max_tokens = sampling.max_tokens or (limit - len(prompt_ids))
        if len(prompt_ids) + max_tokens > limit:
            raise InvalidArgument(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {limit} tokens; lower max_tokens to at most {limit - len(prompt_ids)}")
        if len(resume) >= max_tokens:
            raise InvalidArgument(f"resume_ids already hold {len(resume)} of max_tokens {max_tokens}")
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if len(prompt_ids) + max_tokens > capacity:
            # Permanent for this request (a 400, not a retry-later 429).
            raise InvalidArgument(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) can never fit this engine's KV "
                f"cache of {capacity} tokens; lower max_tokens or raise the engine's --kv-cache-mb")
        if priority not in (0, 1):
            raise InvalidArgument(f"priority {priority} is not 0 (interactive) or 1 (batch)")
        req = Request(request_id, list(prompt_ids), sampling, max_tokens, resume_ids=resume)
        req.priority = priority
        return req

    def add(self, request: Request) -> None:
        with self._lock:
            if len(self._inbox) + self.scheduler.num_waiting >= self.max_waiting:
                raise ResourceExhausted(f"engine queue is full ({self.max_waiting} waiting requests); retry later")
            self._inbox.append(request)
            self._timings[request.request_id] = Timing(arrival_ns=time.time_ns())
            if len(self._timings) > MAX_TIMINGS:
                del self._timings[next(iter(self._timings))]

    def uncached_prefix(self, tokens: Sequence[int]) -> tuple[int, list[bytes]]:
        """(i, hashes): the chained hashes of the usable prompt blocks from block i, the first not cached
        here.  Read-only, for the server's thread: a stale answer costs only a block fetched in vain."""
        hashes = self.blocks.prefix_hashes(tokens)
        cached = self.blocks.cached
        i = 0
        while i < len(hashes) and hashes[i] in cached:
            i += 1
        return i, hashes[i:]

    def pop_timing(self, request_id: str) -> Timing | None:
        """The request's phase timings (once: the entry is dropped)."""
        with self._lock:
            return self._timings.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self._requests or any(r.request_id == request_id for r in self._inbox)
            self._aborts.append(request_id)
        return known

    def has_work(self) -> bool:
        return bool(self._inbox) or bool(self._aborts) or self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs = self._drain()
        self.last_step_tokens = self.last_batch_size = 0
        batch = self.scheduler.schedule()
        self.preemptions += len(batch.preempted)
        if not batch.chunks:
            return outputs
        started = time.perf_counter()
        kv_transfer.import_blocks(self.runner.kv, batch.imports)
        scheduled_ns = time.time_ns()
        for chunk in batch.chunks:
            timing = self._timings.get(chunk.request.request_id)
            if timing is not None and not timing.scheduled_ns:
                timing.scheduled_ns = scheduled_ns
        sampled = [c.request.sampling for c in batch.chunks if c.sample]
        greedy = all(p.greedy and not p.logprobs for p in sampled)
        logits = self.runner.run(batch.chunks, greedy=greedy)
        self.scheduler.commit(batch)
        if self.outbox is not None:
            self._publish(batch, self.outbox)
        outputs.extend(self._postprocess(batch, logits))
        self.last_step_s = time.perf_counter() - started
        self.last_step_tokens = batch.num_tokens
        self.last_batch_size = len(batch.chunks)
        sampled_ns = time.time_ns()
        for chunk in batch.chunks:
            timing = self._timings.get(chunk.request.request_id)
            if chunk.sample and timing is not None and not timing.first_token_ns:
                timing.first_token_ns = sampled_ns
        return outputs

    def fail_all(self) -> list[str]:
        """After a model failure: drop every request (their callers get an error), keep serving."""
        failed = list(self._requests)
        for req in list(self._requests.values()):
            self.scheduler.finish(req)
        self._requests.clear()
        return failed

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
                outputs.append(self._finish(aborted, FinishReason.ABORT, None, ()))
        return outputs

    def _publish(self, batch: Batch, outbox: Outbox) -> None:
        """Copy out the prompt blocks this step filled (after commit registered them) for the shared cache.

        Local hits and imports are never in a chunk, so they are not sent back; a block that merely
        duplicates one another request registered first is skipped too."""
        bs = self.blocks.block_size
        ids: list[int] = []
        hashes: list[bytes] = []
        for chunk in batch.chunks:
            req = chunk.request
            end = min(chunk.start + chunk.num_tokens, len(req.prompt_ids) + len(req.resume_ids))
            for i in range(chunk.start // bs, end // bs):
                block, h = req.table.blocks[i], req.table.hashes[i]
                if self.blocks.block_hash[block] == h:
                    ids.append(block)
                    hashes.append(h)
        if ids:
            exported = kv_transfer.export_blocks_async(self.runner.kv, ids)   # the publisher waits for it
            outbox.put(hashes, exported.kv, exported.ready)

    def _postprocess(self, batch: Batch, logits: torch.Tensor) -> list[StepOutput]:
        """logits: (S, V), or (S,) token ids when every sampled row was greedy."""
        sampled = [c.request for c in batch.chunks if c.sample]
        if logits.dim() == 1:
            tokens = logits.tolist()
        else:
            tokens = sampler.sample_batch(logits, [r.sampling for r in sampled], [r.num_generated for r in sampled])
        outputs = []
        for row, (req, token) in enumerate(zip(sampled, tokens, strict=True)):
            params = req.sampling
            logprobs: tuple[TokenLogprob, ...] = ()
            if params.logprobs:
                logprobs = (sampler.token_logprob(logits[row], token, params.top_logprobs),)
            req.append(token)
            reason = None
            if not params.ignore_eos and (token in self.runner.eos_token_ids or token in params.stop_token_ids):
                reason = FinishReason.STOP
            elif req.num_generated >= req.max_tokens or len(req.all_ids) >= self.runner.max_context:
                reason = FinishReason.LENGTH
            if reason is not None:
                outputs.append(self._finish(req, reason, token, logprobs))
            else:
                outputs.append(StepOutput(req.request_id, (token,), logprobs))
        return outputs

    def _finish(self, req: Request, reason: FinishReason, token: int | None,
                logprobs: tuple[TokenLogprob, ...]) -> StepOutput:
        self.scheduler.finish(req)
        self._requests.pop(req.request_id, None)
        req.finish_reason = reason
        timing = self._timings.get(req.request_id)
        if timing is not None:
            timing.finished_ns = time.time_ns()
        return StepOutput(req.request_id, () if token is None else (token,), logprobs, reason,
                          prompt_tokens=len(req.prompt_ids), completion_tokens=req.num_generated,
                          cached_tokens=req.num_cached_tokens)
