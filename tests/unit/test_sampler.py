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
