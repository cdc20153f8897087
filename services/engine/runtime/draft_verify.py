"""Speculative sampling's rule (Leviathan et al. 2023; Chen et al. 2023): a draft model's tokens kept or replaced so
that what comes out is distributed exactly as the target model alone would sample it.

Draft token x_i (drawn from the draft's distribution q_i) is kept with probability min(1, p_i(x_i) / q_i(x_i)),
p_i being the target's distribution at that position; at the first rejection the token is drawn instead from the
residual max(p_i - q_i, 0), normalized, and the rest of the draft is dropped; when every draft is kept, one more
token comes from the target's next distribution.  For prompt-lookup drafts (services/engine/core/scheduler.py:
q is one token with probability 1) this is the engine's rule today: keep a draft while it equals what the target
samples.  The engine's rule for a draft model's tokens (runtime/draft_model.py, `--draft-model`).

The uniforms come from the request's seeded streams (runtime/sampler.py: step_generator) at each position, one
stream per use, so a seeded request draws the same tokens wherever it runs.  Pure torch, no model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.runtime.sampler import inverse_cdf, step_generator

# Which draw at a position: the draft model's own token, keeping a draft, the residual's token, the bonus token
# after every draft was kept.
DRAFT, KEEP, RESIDUAL, BONUS = 0, 1, 2, 3


def _uniform(seed: int | None, position: int, use: int) -> float:
    stream = None if seed is None else step_generator((seed * 4 + use) % (1 << 64), position)
    return float(torch.rand((), generator=stream))


def draft_uniform(seed: int | None, position: int) -> float:
    """The draft model's draw for its token at `position` (its own seeded stream)."""
    return _uniform(seed, position, DRAFT)


def verify(drafts: Sequence[int], q: torch.Tensor, p: torch.Tensor, seed: int | None = None,
           position: int = 0) -> list[int]:
    """The tokens a step keeps from `drafts` (drawn from q), and the one it draws after them.  q: (k, V) the
    draft's probabilities at each draft's position; p: (k + 1, V) the target's at those positions and the next;
    position: the first draft's position in the request's output (its seeded draws).  1 to k + 1 tokens."""
    if q.shape[0] != len(drafts) or p.shape[0] != len(drafts) + 1 or q.shape[1:] != p.shape[1:]:
        raise ValueError(f"{len(drafts)} drafts need q of {len(drafts)} rows and p of {len(drafts) + 1} rows of "
                         f"one vocabulary; got q {tuple(q.shape)} and p {tuple(p.shape)}")
    ids = torch.arange(p.shape[1])
    out: list[int] = []
    for i, token in enumerate(drafts):
        drafted, target = float(q[i, token]), float(p[i, token])
        if drafted > 0 and _uniform(seed, position + i, KEEP) * drafted <= target:
            out.append(token)
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        out.append(inverse_cdf(ids, residual if float(residual.sum()) > 0 else p[i],
                               _uniform(seed, position + i, RESIDUAL)))
        return out
    out.append(inverse_cdf(ids, p[len(drafts)], _uniform(seed, position + len(drafts), BONUS)))
    return out
