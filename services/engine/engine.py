"""The engine: add / abort / step.  One step runs the model once and returns new tokens.

This first engine serves one request at a time, first come first served: a request is
prefilled, then decoded token by token until it finishes, then the next one starts.
Continuous batching over a paged KV cache replaces `_schedule` and the runner later
without changing this interface.
"""

from __future__ import annotations

import threading
from collections import deque

from mesh.errors import InvalidArgument, ResourceExhausted
from services.engine import sampler
from services.engine.model_runner import ModelRunner
from services.engine.request import (
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    StepOutput,
    TokenLogprob,
)


class Engine:
    def __init__(self, runner: ModelRunner, max_waiting: int = 256):
        self.runner = runner
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: Request | None = None
        # add/abort come from the event loop while step() runs in a worker thread.
        self._lock = threading.Lock()

    # -- admission ---------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     resume_ids: list[int] | None = None) -> Request:
        """Validate a request against the model's limits; raise a precise error if it cannot run."""
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
                f"the prompt has {context} tokens but the model's context is {limit} tokens; "
                "shorten the prompt")
        max_tokens = sampling.max_tokens or (limit - len(prompt_ids))
        if len(prompt_ids) + max_tokens > limit:
            raise InvalidArgument(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {limit} tokens; lower max_tokens to at most {limit - len(prompt_ids)}")
        if len(resume) >= max_tokens:
            raise InvalidArgument(f"resume_ids already hold {len(resume)} of max_tokens {max_tokens}")
        return Request(request_id, list(prompt_ids), sampling, max_tokens, resume_ids=resume)

    def add(self, request: Request) -> None:
        with self._lock:
            if len(self.waiting) >= self.max_waiting:
                raise ResourceExhausted(
                    f"engine queue is full ({self.max_waiting} waiting requests); retry later")
            self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            for req in [*self.waiting, self.running]:
                if req is not None and req.request_id == request_id:
                    req.aborted = True
                    return True
        return False

    def has_work(self) -> bool:
        return self.running is not None or bool(self.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return 0 if self.running is None else 1

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """schedule -> run the model -> postprocess."""
        outputs: list[StepOutput] = []
        req = self._schedule(outputs)
        if req is None:
            return outputs
        if req.kv is None:
            logits, req.kv = self.runner.prefill(req.all_ids)
        else:
            logits, req.kv = self.runner.decode(req.all_ids[-1], req.kv)
        outputs.append(self._postprocess(req, logits))
        return outputs

    def _schedule(self, outputs: list[StepOutput]) -> Request | None:
        with self._lock:
            while True:
                if self.running is None:
                    if not self.waiting:
                        return None
                    self.running = self.waiting.popleft()
                    self.running.status = RequestStatus.RUNNING
                req = self.running
                if not req.aborted:
                    return req
                outputs.append(self._finish(req, FinishReason.ABORT, ()))

    def _postprocess(self, req: Request, logits: object) -> StepOutput:
        import torch

        assert isinstance(logits, torch.Tensor)
        params = req.sampling
        token = sampler.sample(logits, params, req.num_generated)
        logprobs: tuple[TokenLogprob, ...] = ()
        if params.logprobs:
            logprobs = (sampler.token_logprob(logits, token, params.top_logprobs),)
        req.output_ids.append(token)
        reason = None
        if not params.ignore_eos and (token in self.runner.eos_token_ids or token in params.stop_token_ids):
            reason = FinishReason.STOP
        elif req.num_generated >= req.max_tokens or len(req.all_ids) >= self.runner.max_context:
            reason = FinishReason.LENGTH
        if reason is not None:
            return self._finish(req, reason, logprobs)
        return StepOutput(req.request_id, (token,), logprobs)

    def _finish(self, req: Request, reason: FinishReason, logprobs: tuple[TokenLogprob, ...]) -> StepOutput:
        new = () if reason is FinishReason.ABORT else (req.output_ids[-1],)
        req.status, req.finish_reason, req.kv = RequestStatus.FINISHED, reason, None
        if self.running is req:
            self.running = None
        elif req in self.waiting:
            self.waiting.remove(req)
        return StepOutput(req.request_id, new, logprobs, reason,
                          prompt_tokens=len(req.prompt_ids), completion_tokens=req.num_generated)
