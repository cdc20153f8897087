"""Speculative sampling's rule (services/engine/runtime/draft_verify.py): what comes out is distributed as the
target alone samples it, whatever the draft's distribution (chi-square), exact in its corner cases."""

from __future__ import annotations

import pytest
import torch

from services.engine.runtime.draft_verify import verify

P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])       # the target
Q = torch.tensor([0.05, 0.05, 0.30, 0.30, 0.20, 0.10])       # a draft that disagrees with it
CHI2_5_DOF_999 = 20.52                                          # the 0.999 quantile of chi-square, 5 degrees of freedom


def chi2(tokens: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=expected.numel()).double()
    e = expected.double() * len(tokens)
    return float(((counts - e) ** 2 / e).sum())


def test_the_first_token_is_distributed_as_the_target_samples_it() -> None:
    g = torch.Generator().manual_seed(0)
    firsts, seconds = [], []
    for seed in range(8_000):
        drafts = torch.multinomial(Q, 2, replacement=True, generator=g).tolist()   # two drafts from q
        out = verify(drafts, torch.stack([Q, Q]), torch.stack([P, P, P]), seed=seed, position=5)
        firsts.append(out[0])
        if len(out) > 1:
            seconds.append(out[1])
    assert chi2(firsts, P) < CHI2_5_DOF_999, chi2(firsts, P)
    assert chi2(seconds, P) < CHI2_5_DOF_999, chi2(seconds, P)       # the next one too, given the first was kept
    assert 0.2 < len(seconds) / len(firsts) < 0.6           # sum(min(p, q)) = 0.41 of first drafts are kept


def test_a_draft_equal_to_the_target_is_always_kept_and_one_more_drawn() -> None:
    for seed in range(50):
        drafts = [int(torch.multinomial(P, 1, generator=torch.Generator().manual_seed(seed)))] * 3
        assert verify(drafts, torch.stack([P] * 3), torch.stack([P] * 4), seed=seed)[:3] == drafts


def test_a_token_the_target_never_samples_is_never_kept() -> None:
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 1.0, 0.0])
    for seed in range(100):
        out = verify([2], q[None], torch.stack([p, p]), seed=seed)
        assert len(out) == 1 and out[0] in (0, 1)          # rejected; drawn from the residual, p's own support


def test_prompt_lookup_drafts_are_the_same_rule() -> None:
    """A one-hot draft (prompt lookup) is kept with probability p(x): as often as the target samples it."""
    p = torch.tensor([0.7, 0.2, 0.1])
    one_hot = torch.tensor([[1.0, 0.0, 0.0]])
    kept = sum(verify([0], one_hot, torch.stack([p, p]), seed=s)[0] == 0 for s in range(4_000))
    assert abs(kept / 4_000 - 0.7) < 0.03


def test_seeded_draws_repeat_and_shapes_are_checked() -> None:
    drafts = [3, 2]
    args = (drafts, torch.stack([Q, Q]), torch.stack([P, P, P]))
    assert verify(*args, seed=42, position=9) == verify(*args, seed=42, position=9)
    with pytest.raises(ValueError, match="2 drafts need q of 2 rows and p of 3 rows"):
        verify(drafts, Q[None], torch.stack([P, P, P]))
