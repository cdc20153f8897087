"""Draft-model speculative decoding on the real model (services/engine/runtime/draft_model.py): greedy output
token for token the one decoding without a draft gives; sampled output distributed as the model alone samples
it (chi-square, against the model's own distribution, and far from the draft's); seeded output repeats.

The draft is the default model with its norms' weights perturbed: the same tokenizer, a distribution near the
model's but not equal to it, so that drafts are both kept and rejected."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from services.engine.core.request import FinishReason, SamplingParams, StepOutput
from services.engine.core.speculate import SpeculationConfig
from services.engine.engine import Engine
from services.engine.runtime.draft_model import DraftModel, check_compatible
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.models.config import load_weights
from services.engine.runtime.plan import decide
from tests.service.test_engine import chat_ids

ALWAYS = SpeculationConfig(max_draft=3, max_rows=32, measure=False)   # draft at every size (no DraftGain)
PROMPTS = ["Tell me about the history of Rome.", "Write the numbers from 1 to 30 separated by commas.",
           "What is a good name for a cat?"]


@pytest.fixture(scope="module")
def plan():  # type: ignore[no-untyped-def]
    return decide(device="cpu", dtype="float32", matmul="q4")


@pytest.fixture(scope="module")
def runner(model_dir: Path, plan) -> ModelRunner:  # type: ignore[no-untyped-def]
    return ModelRunner(model_dir, plan, kv_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def draft_runner(model_dir: Path, plan) -> ModelRunner:  # type: ignore[no-untyped-def]
    weights = load_weights(model_dir)
    noise = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if isinstance(w, torch.Tensor) and name.endswith("layernorm.weight"):
            weights[name] = w * (1 + 0.25 * torch.randn(w.shape, generator=noise))
    return ModelRunner(model_dir, plan, kv_cache_bytes=64 << 20, weights=weights)


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [chat_ids(hf_tokenizer, p) for p in PROMPTS]


def generate(runner: ModelRunner, draft: ModelRunner | None, prompts: list[list[int]], params: SamplingParams,
             speculation: SpeculationConfig = ALWAYS) -> tuple[dict[str, list[int]], Engine]:
    engine = Engine(runner, speculation=speculation if draft is not None else None,
                    draft=DraftModel(draft, runner.vocab_size) if draft is not None else None)
    for i, ids in enumerate(prompts):
        engine.add(engine.make_request(str(i), ids, params))
    outputs: dict[str, list[StepOutput]] = {}
    for rid, outs in engine.run_until_idle().items():
        outputs[rid] = outs
    return {rid: [t for o in outs for t in o.new_ids] for rid, outs in outputs.items()}, engine


def test_greedy_output_is_the_models_own_and_drafts_are_kept_and_rejected(
        runner: ModelRunner, draft_runner: ModelRunner, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=48)
    plain, _ = generate(runner, None, prompts, params)
    for batch in (prompts[:1], prompts):                # one stream, and three drafting together
        drafted, engine = generate(runner, draft_runner, batch, params)
        assert drafted == {k: v for k, v in plain.items() if int(k) < len(batch)}
        stats = engine.stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens, (stats.accepted_tokens, stats.draft_tokens)
        assert engine.draft is not None and engine.draft.blocks.num_used_blocks == 0   # every request's released


def test_logprobs_and_max_tokens_with_a_draft_model(runner: ModelRunner, draft_runner: ModelRunner,
                                                    prompts: list[list[int]]) -> None:
    for max_tokens in (1, 2, 9):
        params = SamplingParams(max_tokens=max_tokens, logprobs=True, top_logprobs=2, ignore_eos=True)
        engine = Engine(runner, speculation=ALWAYS, draft=DraftModel(draft_runner, runner.vocab_size))
        engine.add(engine.make_request("a", prompts[1], params))
        outs = engine.run_until_idle()["a"]
        got = [t for o in outs for t in o.new_ids]
        assert len(got) == max_tokens and outs[-1].finish_reason is FinishReason.LENGTH
        assert [lp.token_id for o in outs for lp in o.logprobs] == got


def test_seeded_sampling_repeats_with_the_same_draft(runner: ModelRunner, draft_runner: ModelRunner,
                                                     prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=7)
    first, engine = generate(runner, draft_runner, prompts[:2], params)
    again, _ = generate(runner, draft_runner, prompts[:2], params)
    assert first == again and engine.stats.draft_tokens > 0
    other, _ = generate(runner, draft_runner, prompts[:2], SamplingParams(max_tokens=40, temperature=0.8,
                                                                          top_p=0.95, seed=8))
    assert other != first


def chi2_quantile(dof: int, z: float = 3.09) -> float:
    """The chi-square distribution's quantile at the normal quantile z (3.09: 0.999), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(pairs: list[tuple[int, int]], expected: dict[int, dict[int, float]]) -> tuple[float, int]:
    """Sum over the first tokens of the chi-square of the second tokens against expected[first] (categories
    expected fewer than 5 times merged into one); (statistic, degrees of freedom)."""
    total, dof = 0.0, 0
    for first, seconds in _group(pairs).items():
        n = len(seconds)
        counts = Counter(seconds)
        cells: list[tuple[float, float]] = []         # (observed, expected)
        rest_o, rest_e = 0.0, 0.0
        for token, p in expected[first].items():
            if n * p >= 5:
                cells.append((counts.pop(token, 0), n * p))
            else:
                rest_o, rest_e = rest_o + counts.pop(token, 0), rest_e + n * p
        rest_o += sum(counts.values())                # tokens the distribution says never come (p 0)
        if rest_e >= 5 or rest_o:
            cells.append((rest_o, max(rest_e, 1e-9)))
        if len(cells) > 1:
            total += sum((o - e) ** 2 / e for o, e in cells)
            dof += len(cells) - 1
    return total, dof


def _group(pairs: list[tuple[int, int]]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for first, second in pairs:
        groups.setdefault(first, []).append(second)
    return {k: v for k, v in groups.items() if len(v) >= 20}


def next_distribution(runner: ModelRunner, ids: list[int], params: SamplingParams) -> dict[int, float]:
    """The model's sampling distribution (top_k of a temperature 1 softmax) for the token after `ids`."""
    engine = Engine(runner)
    engine.add(engine.make_request("p", ids, SamplingParams(max_tokens=1, logprobs=True,
                                                            top_logprobs=params.top_k)))
    top = engine.run_until_idle()["p"][0].logprobs[0].top
    weights = {token: math.exp(lp) for token, lp in top}
    total = sum(weights.values())
    return {token: w / total for token, w in weights.items()}


@pytest.mark.slow
def test_sampled_tokens_are_distributed_as_the_model_samples_them(
        runner: ModelRunner, draft_runner: ModelRunner, prompts: list[list[int]]) -> None:
    """The second token of each answer comes out of a drafted step (two drafts, verified by the rule): given
    the first, it follows the model's distribution, not the draft's (which the same counts reject)."""
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)
    prompt = prompts[2]
    pairs: list[tuple[int, int]] = []
    drafted = 0
    for _ in range(16):                                 # 16 x 12 answers, 12 drafting together
        out, engine = generate(runner, draft_runner, [prompt] * 12, params,
                               SpeculationConfig(max_draft=2, max_rows=64, measure=False))
        pairs += [(ids[0], ids[1]) for ids in out.values()]
        drafted += engine.stats.draft_tokens
    assert drafted >= len(pairs)                        # every answer's second token was verified, not plain
    firsts = {first for first, _ in pairs}
    model = {first: next_distribution(runner, [*prompt, first], params) for first in firsts}
    draft = {first: next_distribution(draft_runner, [*prompt, first], params) for first in firsts}
    statistic, dof = chi2(pairs, model)
    assert dof >= 2 and statistic < chi2_quantile(dof), (statistic, dof, Counter(pairs))
    against_draft, dof_draft = chi2(pairs, draft)
    assert against_draft > chi2_quantile(dof_draft), "the draft is too close to the model for this test to fail"


def test_a_draft_of_another_vocabulary_is_refused(runner: ModelRunner) -> None:
    class Other:
        vocab_size = runner.vocab_size + 1
        eos_token_ids = runner.eos_token_ids
        folder = runner.folder
    with pytest.raises(ValueError, match="vocabulary"):
        check_compatible(runner, Other())  # type: ignore[arg-type]


def test_a_failing_draft_model_leaves_the_requests_running(runner: ModelRunner, draft_runner: ModelRunner,
                                                           prompts: list[list[int]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(max_tokens=24)
    plain, _ = generate(runner, None, prompts[:1], params)
    engine = Engine(runner, speculation=ALWAYS, draft=DraftModel(draft_runner, runner.vocab_size))
    assert engine.draft is not None

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the draft's kernel failed")
    monkeypatch.setattr(engine.draft.runner, "run", broken)
    engine.add(engine.make_request("a", prompts[0], params))
    outs = engine.run_until_idle()["a"]
    assert [t for o in outs for t in o.new_ids] == plain["0"] and outs[-1].finish_reason is FinishReason.LENGTH
    assert engine.stats.draft_tokens == 0 and engine.draft.blocks.num_used_blocks == 0
