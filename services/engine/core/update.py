"""After the model ran: a step's sampled tokens taken into its requests, and the ends they reach.

The step's postprocess, in one pass over its sampled chunks (nano-vllm's Scheduler.postprocess, vLLM v1's
Scheduler.update_from_output).  A chunk with drafts (speculate.py) has 1 + draft rows, row i sampled as the
token at its own position would be without drafts (sampler.sample_rows); its tokens are taken in order
while each equals the draft it verified, so the first that differs (or the one after the last draft) is
the last taken.  Each token taken advances the request's grammar and reads its log-probability from the
model's own logits; the first that ends the request (a complete grammar, an end-of-sequence or stop id,
max_tokens, the context) is its last, and the request ends there, through `end` (Engine._finish: where
every request ends, stopped, aborted or failed).  The accepted drafts' KV counts as computed.

Plain Python over the batch's requests but for reading log-probs: no clocks, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import TYPE_CHECKING, NamedTuple, Protocol

from services.engine.core.request import EngineTokenLogprob, FinishReason, Request, StepOutput
from services.engine.runtime import sampler

if TYPE_CHECKING:
    import torch

    from services.engine.core.block_manager import BlockManager
    from services.engine.core.scheduler import Batch, Chunk


class Rules(NamedTuple):
    """The model's limits a request ends at, beside its own sampling parameters, and speculation's."""

    eos_token_ids: Set[int]     # the model's end-of-sequence ids
    max_context: int            # prompt + output tokens
    max_draft: int = 0          # speculation's drafts per request and step (adaptive lengths stay within)


class Update(NamedTuple):
    outputs: list[StepOutput]   # one per sampled chunk, in the batch's order
    drafted: int                # draft tokens verified this step,
    accepted: int               # and of them, accepted


class End(Protocol):
    def __call__(self, req: Request, reason: FinishReason, tokens: tuple[int, ...],
                 logprobs: tuple[EngineTokenLogprob, ...], prompt: tuple[EngineTokenLogprob, ...]) -> StepOutput:
        """End `req` for `reason`: its last output, carrying this step's tokens."""
        ...


def update_from_output(batch: Batch, tokens: Sequence[int], logits: torch.Tensor, rules: Rules,
                       blocks: BlockManager, end: End) -> Update:
    """Each sampled chunk's tokens (tokens[k] sampled from row k of `logits`, (R, V), or (R,) ids when every
    row was greedy: then no row wants logprobs) taken into its request: its output, or its end."""
    outputs: list[StepOutput] = []
    drafted = accepted = 0
    row = 0
    for chunk in batch.chunks:
        if not chunk.sample:
            continue
        req, params = chunk.request, chunk.request.sampling
        new: list[int] = []
        logprobs: list[EngineTokenLogprob] = []
        reason = None
        for i in range(1 + chunk.draft):
            token = tokens[row + i]
            if params.logprobs:
                logprobs.append(sampler.token_logprob(logits[row + i], token, params.top_logprobs))
            req.append(token)
            new.append(token)
            if req.matcher is not None and not req.matcher.accept(token):
                reason = FinishReason.ERROR      # (cannot happen: the mask allowed it) fail this one only
                break
            reason = finish_reason(req, token, rules)
            if reason is not None or i == chunk.draft or token != req.draft[i]:
                break
        row += 1 + chunk.draft
        if chunk.draft:
            drafted += chunk.draft
            accepted += keep_drafts(chunk, new, blocks, rules.max_draft)
        prompt = tuple(req.prompt_logprobs) if req.prompt_logprobs and len(req.output_ids) == len(new) else ()
        if reason is None:
            outputs.append(StepOutput(req.request_id, tuple(new), tuple(logprobs), prompt_logprobs=prompt))
        else:
            outputs.append(end(req, reason, tuple(new), tuple(logprobs), prompt))
    return Update(outputs, drafted, accepted)


def finish_reason(req: Request, token: int, rules: Rules) -> FinishReason | None:
    """Whether `token`, just taken, ends the request: a complete grammar, an end-of-sequence or stop id
    (unless ignore_eos), max_tokens or the context reached."""
    params = req.sampling
    if req.matcher is not None and req.matcher.done:
        return FinishReason.STOP             # the grammar is complete (even with ignore_eos)
    if not params.ignore_eos and (token in rules.eos_token_ids or token in params.stop_token_ids):
        return FinishReason.STOP
    if req.num_generated >= req.max_tokens or len(req.all_ids) >= rules.max_context:
        return FinishReason.LENGTH
    return None


def keep_drafts(chunk: Chunk, new: Sequence[int], blocks: BlockManager, max_draft: int) -> int:
    """After a chunk with drafts took `new`: the accepted drafts' KV is valid (their rows ran on the tokens
    that were then sampled), so it counts as computed; the rest is overwritten later.  The request's draft
    length adapts.  Returns the drafts accepted."""
    req = chunk.request
    accepted = next((i for i, t in enumerate(new[:chunk.draft]) if t != req.draft[i]), min(len(new), chunk.draft))
    req.num_computed = chunk.start + 1 + min(accepted, len(new) - 1)
    blocks.commit(req.table, req.all_ids, req.num_computed)
    if req.lookup is not None:
        req.lookup.update(chunk.draft, accepted, max_draft)
    return accepted
