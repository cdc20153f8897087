import pytest
import torch

from mesh.errors import InvalidArgument
from services.engine.core.request import SamplingParams
from services.engine.runtime import sampler


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
    from services.engine.runtime.sampler import process

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
    from services.engine.runtime.sampler import filter_logits

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


def _peaked(vocab: int, seed: int) -> torch.Tensor:
    """Logits shaped like a language model's: a few likely tokens over a long tail."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 2.0 + torch.where(torch.rand(vocab, generator=g) < 0.002, 8.0, 0.0)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=0.8, top_k=1000, top_p=0.9), SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.3, top_p=0.99, min_p=0.01), SamplingParams(temperature=0.7),
    SamplingParams(temperature=2.0, top_p=0.95),          # flat: the nucleus reaches past the candidates
])
def test_the_fast_path_draws_what_the_reference_draws(params: SamplingParams) -> None:
    """Candidates instead of a sort of the vocabulary: the same token for the same seed and position, on
    peaked and flat rows of a 32,000-token vocabulary (the flat one past every candidate: flat_filter)."""
    import dataclasses
    same = total = 0
    for seed in range(40):
        row = _peaked(32_000, seed)
        for position in range(5):
            p = dataclasses.replace(params, seed=seed * 7 + position)
            total += 1
            same += sampler.sample(row, p, position) == sampler.reference_sample(row, p, position)
    assert same >= total - 1, (same, total)        # one rounding at a bucket's edge allowed


def test_a_flat_row_is_drawn_among_wider_candidates_before_any_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose top_p nucleus holds ~1,000 tokens (past the first 256 candidates, within the 4,096 of the
    second try): the reference's token for every seed, and the sort is never taken."""
    import dataclasses
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(152_000, generator=gen) * 0.1 - 12.0
    row[torch.randperm(152_000, generator=gen)[:1000]] += 12.0 + torch.rand(1000, generator=gen)
    want = [sampler.reference_sample(row, SamplingParams(temperature=0.7, top_p=0.95, seed=s), 0) for s in range(30)]

    def no_sort(*args: object) -> int:
        raise AssertionError("the row took the sort")

    monkeypatch.setattr(sampler, "reference_sample", no_sort)
    params = SamplingParams(temperature=0.7, top_p=0.95)
    got = [sampler.sample_batch(row.unsqueeze(0), [dataclasses.replace(params, seed=s)], [0])[0] for s in range(30)]
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 29


def test_a_batch_mixes_greedy_whole_vocabulary_and_nucleus_rows() -> None:
    rows = torch.stack([_peaked(5_000, s) for s in range(4)])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=0.7, top_p=0.9, seed=2), SamplingParams(temperature=1.0, top_k=5, seed=3)]
    got = sampler.sample_batch(rows, params, [3, 3, 3, 3])
    assert got == [sampler.reference_sample(rows[i], params[i], 3) for i in range(4)]
    assert got[0] == int(rows[0].argmax())


def test_nucleus_sampling_follows_the_renormalized_distribution() -> None:
    """Chi-square over 6,000 seeded draws with top_p 0.8 on ten known probabilities (and a long tail): the
    kept tokens come up as their renormalized probabilities say (below the 0.999 quantile), the cut never."""
    probs = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.08, 0.07, 0.05, 0.03, 0.01, 0.01])
    logits = torch.cat([torch.log(probs), torch.full((2_000,), -30.0)])
    kept = 5                      # mass before token 5 is 0.83 >= 0.8: tokens 0-4 stay
    expected = probs[:kept] / probs[:kept].sum()
    draws = torch.tensor([sampler.sample(logits, SamplingParams(temperature=1.0, top_p=0.8, seed=s), 0)
                          for s in range(6_000)])
    assert int((draws >= kept).sum()) == 0
    counts = torch.bincount(draws, minlength=kept)[:kept].double()
    chi2 = float(((counts - 6_000 * expected) ** 2 / (6_000 * expected)).sum())
    assert chi2 < 18.47, chi2     # the 0.999 quantile of chi-square with 4 degrees of freedom


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.5}, {"top_k": 5}, {"min_p": 0.5}])
def test_a_temperature_too_small_to_scale_by_samples_greedily(extra: dict[str, float]) -> None:
    # 1e-40 overflows float32 logits / temperature (the edge fuzz found one that failed the engine's step).
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(max_tokens=4, temperature=1e-40, **extra)  # type: ignore[arg-type]
    assert params.greedy
    assert list(sampler.sample_batch(logits, [params] * 3, [0, 1, 2])) == logits.argmax(-1).tolist()


def test_bad_words_ban_the_token_that_would_complete_one() -> None:
    """vLLM's bad_words, as token sequences (the router tokenized them): a one-token word is never chosen; a
    longer one's last token only where the tokens before it were just generated."""
    from services.engine.runtime.sampler import process

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0])
    params = SamplingParams(bad_words_ids=((3,), (1, 2, 4)))
    assert process(logits, params, [9], [], set()).tolist() == [2.0, -1.0, 0.5, float("-inf"), 1.0]
    assert process(logits, params, [], [0, 1, 2], set())[4] == float("-inf")      # 1, 2 just generated
    assert process(logits, params, [], [1, 0, 2], set())[4] == 1.0                # not in a row
    assert process(logits, params, [1, 2], [], set())[4] == 1.0                   # the prompt's do not count
    assert process(logits, SamplingParams(bad_words_ids=((7,),)), [], [], set()).tolist() == logits.tolist()
    assert params.penalized and params.processed                   # full logits, its own history, no drafts


class _Allows:
    """A grammar matcher that allows `tokens` next (its fill sets their bits of the batch's bitmask)."""

    def __init__(self, tokens: set[int]):
        self.tokens = tokens

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.tokens:
            bitmask[row, t // 32] |= 1 << (t % 32)


def test_sample_rows_processes_masks_and_samples_every_row_in_one_call() -> None:
    """Each row as its request's penalties, grammar and sampler leave it, at its own position (a draft row:
    one further); the model's logits are left as they were, for logprobs."""
    from services.engine.core.request import Request

    def request(rid: str, generated: int = 0, **params: object) -> Request:
        r = Request(rid, [1, 2], SamplingParams(max_tokens=8, **params), max_tokens=8)  # type: ignore[arg-type]
        r.output_ids = [4] * generated
        return r

    rows = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.9],     # biased: 0 wins
                         [9.0, 3.0, 2.0, 0.5, 2.9],     # min_tokens bans the end-of-sequence id 0: 1
                         [1.0, 3.0, 2.0, 0.5, 2.9],     # its grammar allows 2 and 3: 2
                         [1.0, 3.0, 2.0, 0.5, 2.9],     # seeded, as a decode's first row,
                         [1.0, 3.0, 2.0, 0.5, 2.9]])    # and the row after it (a draft's)
    biased = request("biased", logit_bias=((0, 5.0),))
    early = request("early", min_tokens=2)
    constrained = request("constrained")
    constrained.matcher = _Allows({2, 3})  # type: ignore[assignment]
    seeded = request("seeded", generated=3, temperature=1.5, seed=7)
    before = rows.clone()
    got = sampler.sample_rows(rows, [(biased, 0), (early, 0), (constrained, 0), (seeded, 0), (seeded, 1)],
                              frozenset({0}))
    assert got[:3] == [0, 1, 2]
    assert got[3:] == [sampler.sample(rows[3], seeded.sampling, 3), sampler.sample(rows[4], seeded.sampling, 4)]
    assert torch.equal(rows, before)


def test_sample_rows_takes_the_models_ids_when_every_row_was_greedy() -> None:
    assert sampler.sample_rows(torch.tensor([5, 2, 9]), [], frozenset()) == [5, 2, 9]


@pytest.mark.parametrize("scale,temperature,top_p,min_p", [(0.3, 0.7, 0.95, 0.0), (1.0, 1.0, 0.9, 0.0),
                                                           (3.0, 0.5, 0.99, 0.0), (1.0, 1.5, 0.5, 0.01),
                                                           (8.0, 0.7, 0.95, 0.0)])
def test_a_flat_rows_cut_without_the_sort_keeps_the_sorts_tokens(scale: float, temperature: float, top_p: float,
                                                                  min_p: float) -> None:
    """flat_filter (binning, then a sort of the band at the cut) against filter_logits' sort of the whole row:
    the same tokens but a few at the edge, where the two float sums of the mass round apart."""
    row = torch.randn(151_936, generator=torch.Generator().manual_seed(int(scale * 10))) * scale
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p)
    want, got = torch.isfinite(sampler.filter_logits(row, params)), torch.isfinite(sampler.flat_filter(row, params))
    probs = torch.softmax(row / temperature, dim=-1)
    differ = want ^ got
    assert int(differ.sum()) <= 10 and float(probs[differ].sum()) < 1e-4, (int(want.sum()), int(got.sum()))


def test_a_flat_row_of_ties_is_cut_at_once() -> None:
    uniform = sampler.flat_filter(torch.zeros(151_936), SamplingParams(temperature=1.0, top_p=0.5))
    assert bool(torch.isfinite(uniform).all())          # every token is tied at the cut: all stay, equally likely
