"""Turn one row of logits into a token: greedy, or temperature / top-k / top-p with a seed.

The random stream of a seeded request depends only on (seed, position), so a stream
resumed on another replica after a failover draws the same tokens it would have drawn.
"""

from __future__ import annotations

import torch

from services.engine.request import SamplingParams, TokenLogprob

_SEED_MIX = 1_000_003
_SEED_MOD = 2**63 - 1


def step_generator(seed: int | None, position: int) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * _SEED_MIX + position) % _SEED_MOD)


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
    return scaled


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """logits: (V,) float32 for one sequence; position: index of the token being generated."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=step_generator(params.seed, position)))


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
