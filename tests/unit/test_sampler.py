import pytest
import torch

from mesh.errors import InvalidArgument
from services.engine import sampler
from services.engine.request import SamplingParams


def logits() -> torch.Tensor:
    return torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])


def test_greedy_is_argmax() -> None:
    assert sampler.sample(logits(), SamplingParams(temperature=0), 0) == 1


def test_top_k_one_is_argmax() -> None:
    params = SamplingParams(temperature=1.0, top_k=1, seed=3)
    assert {sampler.sample(logits(), params, p) for p in range(20)} == {1}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.5)
    kept = torch.isfinite(sampler.filter_logits(logits(), params))
    assert kept.tolist() == [False, True, False, False, True]


def test_seeded_sampling_depends_only_on_seed_and_position() -> None:
    params = SamplingParams(temperature=1.5, seed=42)
    first = [sampler.sample(logits(), params, p) for p in range(30)]
    again = [sampler.sample(logits(), params, p) for p in range(30)]
    assert first == again
    assert len(set(first)) > 1


def test_logprob_of_chosen_token() -> None:
    lp = sampler.token_logprob(logits(), 1, top=2)
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits(), -1)[1]))
    assert [t for t, _ in lp.top] == [1, 4]


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 1.5}, {"top_k": -1}, {"max_tokens": -2},
                                    {"top_logprobs": 21}])
def test_invalid_params_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        SamplingParams(**kwargs)


def test_processing_bias_penalties_and_min_tokens() -> None:
    """sampler.process, term by term, against the definitions (OpenAI's penalties, vLLM's repetition)."""
    from services.engine.sampler import process

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0])
    plain = SamplingParams()
    assert torch.equal(process(logits, plain, [], [], {4}), logits)
    biased = process(logits, SamplingParams(logit_bias=((3, -100.0), (1, 2.0))), [], [], set())
    assert biased.tolist() == [2.0, 1.0, 0.5, -97.0, 1.0] and logits[3] == 3.0      # the input is kept
    rep = process(logits, SamplingParams(repetition_penalty=2.0), [0], [1], set())
    assert rep.tolist() == [1.0, -2.0, 0.5, 3.0, 1.0]            # seen: positive / 2, negative x 2
    pen = process(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), [3], [2, 2, 0], set())
    assert pen.tolist() == [2.0 - 1.5, -1.0, 0.5 - 2.0, 3.0, 1.0]   # output tokens only, count x 0.5 + 1
    early = process(logits, SamplingParams(min_tokens=2), [], [0], {3, 4})
    assert early[3] == float("-inf") and early[4] == float("-inf") and early[0] == 2.0
    assert torch.equal(process(logits, SamplingParams(min_tokens=1), [], [0], {3, 4}), logits)


def test_min_p_keeps_tokens_near_the_top() -> None:
    from services.engine.sampler import filter_logits

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_logits(logits, SamplingParams(temperature=1.0, min_p=0.2))   # >= 0.2 x 0.5 = 0.1
    assert torch.isfinite(kept).tolist() == [True, True, True, False]
    assert all(sampler.sample(logits, SamplingParams(temperature=1.0, min_p=0.7, seed=s), 0) == 0 for s in range(20))


def test_sampling_follows_the_distribution_and_never_picks_a_masked_token() -> None:
    """Inverse-CDF sampling: frequencies within a few standard errors of the softmax probabilities over
    4,000 seeded draws; tokens at -inf (a grammar's mask, top-k's cut) never come up."""
    logits = torch.full((1000,), float("-inf"))
    logits[[3, 500, 998]] = torch.tensor([0.0, 1.0, 2.0])
    probs = torch.softmax(logits, dim=-1)
    draws = [sampler.sample(logits, SamplingParams(temperature=1.0, seed=s), 0) for s in range(4000)]
    counts = {t: draws.count(t) for t in set(draws)}
    assert set(counts) == {3, 500, 998}
    for t, c in counts.items():
        p = float(probs[t])
        assert abs(c / 4000 - p) < 4 * (p * (1 - p) / 4000) ** 0.5, (t, c, p)
    edge = torch.full((50,), float("-inf"))
    edge[0] = 0.0                            # the only token is the first: a draw of 0 must still land on it
    edge2 = torch.full((50,), float("-inf"))
    edge2[49] = 0.0                          # or the last: a draw rounding up to the total too
    assert {sampler.sample(edge, SamplingParams(temperature=1.0, seed=s), 0) for s in range(50)} == {0}
    assert {sampler.sample(edge2, SamplingParams(temperature=1.0, seed=s), 0) for s in range(50)} == {49}
