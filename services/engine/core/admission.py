"""A request's admission checks: the model's context, the KV cache's size, the fields' ranges."""

from __future__ import annotations

import dataclasses

from mesh.errors import InvalidArgument
from mesh.models.folder import pooling_mode
from services.engine.core.block_manager import BlockManager
from services.engine.core.fairness import check_weight
from services.engine.core.request import COMMON, EngineTokenLogprob, Owner, Request, SamplingParams
from services.engine.runtime.model_runner import ModelRunner


def build_request(runner: ModelRunner, blocks: BlockManager, request_id: str, prompt_ids: list[int],
                  sampling: SamplingParams, resume_ids: list[int] | None = None, owner: Owner = COMMON,
                  cache_salt: bytes = b"") -> Request:
    """Validate a request against the model's and the KV cache's limits; raise a precise error."""
    resume = list(resume_ids or [])
    limit = runner.max_context
    if not prompt_ids:
        raise InvalidArgument("the prompt is empty")
    if runner.task == "embed" and not sampling.pooling:
        raise InvalidArgument("this model is an embedding model: it serves embeddings only (POST /v1/embeddings, "
                              "or SamplingParams.pooling), not completions")
    bad = next((i for i in prompt_ids + resume + [t for t, _ in sampling.logit_bias] + list(sampling.stop_token_ids)
                if not 0 <= i < runner.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"token id {bad} is outside the vocabulary (size {runner.vocab_size})")
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
    capacity = blocks.num_blocks * blocks.block_size
    if len(prompt_ids) + max_tokens > capacity:
        # Permanent for this request (a 400, not a retry-later 429).
        raise InvalidArgument(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) can never fit this engine's KV "
            f"cache of {capacity} tokens; lower max_tokens or raise the engine's --kv-cache-mb")
    if len(cache_salt) > 256:
        raise InvalidArgument(f"cache_salt is {len(cache_salt)} bytes; at most 256")
    _check_owner(owner)
    if getattr(runner.model, "dynamic", False) and len(prompt_ids) > runner.config.max_position:
        # Dynamic NTK rotates this prompt at its own length: its blocks are not another prompt's.
        cache_salt = cache_salt + b"|ntk:%d" % len(prompt_ids)
    if sampling.pooling == "model":
        sampling = dataclasses.replace(sampling, pooling=pooling_mode(runner.folder))
    if sampling.prompt_logprobs or sampling.pooling:
        # Every prompt position is computed (its logits or hidden states are wanted): a namespace no other
        # request shares.
        cache_salt = cache_salt + b"|whole-prompt:" + request_id.encode()
    req = Request(request_id, list(prompt_ids), sampling, max_tokens, resume_ids=resume, cache_salt=cache_salt)
    req.priority, req.tenant, req.weight = owner
    if sampling.prompt_logprobs:
        req.prompt_logprobs.append(EngineTokenLogprob(prompt_ids[0], float("nan")))
    return req


def _check_owner(owner: Owner) -> None:
    if owner.priority not in (0, 1):
        raise InvalidArgument(f"priority {owner.priority} is not 0 (interactive) or 1 (batch)")
    if len(owner.tenant) > 256:
        raise InvalidArgument(f"tenant is {len(owner.tenant)} characters; at most 256")
    try:
        check_weight(owner.weight)
    except ValueError as exc:
        raise InvalidArgument(f"the tenant's {exc}") from None
