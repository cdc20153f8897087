"""Turn one row of logits into a token: greedy, or temperature / top-k / top-p with a seed.

The random stream of a seeded request depends only on (seed, position), so a stream
resumed on another replica after a failover draws the same tokens it would have drawn.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from services.engine.request import SamplingParams, TokenLogprob

_SEED_MIX = 1_000_003
_SEED_MOD = 2**63 - 1


def step_generator(seed: int | None, position: int) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * _SEED_MIX + position) % _SEED_MOD)


def process(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int],
            ended_by: Collection[int]) -> torch.Tensor:
    """One row's logits as the request's processors leave them (a new tensor; `logits` is kept for
    logprobs): min_tokens bans `ended_by` (end-of-sequence and stop ids) until that many are out;
    logit_bias adds; repetition_penalty divides positive logits (multiplies negative ones) of tokens in
    the prompt or output; frequency and presence penalties subtract count x frequency + presence for
    each token generated so far (OpenAI's definition).  logits: (V,) float32."""
    out = logits.clone()
    vocab = out.shape[0]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64)
        out.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype))
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64)
        if seen.numel():
            values = out[seen]
            out[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64), minlength=vocab).to(out.dtype)
        out -= counts * params.frequency_penalty + (counts > 0).to(out.dtype) * params.presence_penalty
    if params.min_tokens and len(output_ids) < params.min_tokens and ended_by:
        out[torch.tensor(sorted(ended_by), dtype=torch.int64)] = float("-inf")
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scaled and masked logits; masked entries are -inf.  logits: (V,) float32."""
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        # Tokens whose probability is below min_p x the most likely one's (after temperature).
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scaled


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """logits: (V,) float32 for one sequence; position: index of the token being generated."""
    if params.greedy:
        return int(torch.argmax(logits))
    # Inverse CDF: one uniform draw against the cumulative distribution (torch.multinomial over a
    # 49k vocabulary costs ~10x more on the CPU).  The first token whose cumulative mass exceeds the
    # draw: never one of probability 0, so masked tokens are never chosen.
    cdf = torch.softmax(filter_logits(logits, params), dim=-1).cumsum(dim=-1)
    u = torch.rand((), generator=step_generator(params.seed, position))
    token = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if token >= cdf.numel():                 # u * total rounded up to the total itself
        token = int(torch.nonzero(torch.diff(cdf, prepend=cdf.new_zeros(1)) > 0).max())
    return token


def token_logprob(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    """Logprob of the chosen token under the unmodified distribution, plus the top alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logprobs, top)
        alternatives = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return TokenLogprob(token_id, float(logprobs[token_id]), alternatives)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """logits: (B, V) float32; one token per row, each row with its own parameters."""
    if not params:
        return []
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [g if p.greedy else sample(logits[i], p, pos)
            for i, (g, p, pos) in enumerate(zip(greedy, params, positions, strict=True))]
