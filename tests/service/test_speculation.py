"""Prompt-lookup speculative decoding on the real model (services/engine/core/speculate.py): the output is
the one decoding without drafts gives, greedy and seeded, token for token, and drafts are taken."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.engine.core.request import FinishReason, SamplingParams, StepOutput
from services.engine.core.speculate import SpeculationConfig
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide

# Text that repeats itself: the lookup finds its drafts in the prompt and in what the model writes.
PROMPTS = [
    "Copy this list three times: red, green, blue, yellow, red, green, blue, yellow, red, green, blue, yellow.",
    "Write the numbers from 1 to 40 separated by commas.",
]
ON = SpeculationConfig(max_draft=3, max_rows=4)


@pytest.fixture(scope="module", params=[pytest.param("exact", marks=pytest.mark.slow), "fast"])
def runner(model_dir: Path, request: pytest.FixtureRequest) -> ModelRunner:
    """--dtype float32 (transformers' math) and the CPU's fast kinds with the float16 KV cache (the
    row budget stays within the small-batch kind, so both ways run the same kernels per row).  float32 steps
    ~3x slower on a CPU: `make test-fast` runs the fast kinds only (marker `slow`)."""
    plan = decide(device="cpu", dtype="float32") if request.param == "exact" else \
        decide(device="cpu", dtype="float32", matmul="q4")
    return ModelRunner(model_dir, plan, kv_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [list(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                                add_generation_prompt=True),
                                  add_special_tokens=False)) for p in PROMPTS]


def generate(runner: ModelRunner, speculation: SpeculationConfig | None, prompts: list[list[int]],
             params: SamplingParams) -> tuple[dict[str, list[StepOutput]], Engine, int]:
    engine = Engine(runner, speculation=speculation)
    for i, ids in enumerate(prompts):
        engine.add(engine.make_request(str(i), ids, params))
    outputs: dict[str, list[StepOutput]] = {}
    steps = 0
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        steps += 1
    return outputs, engine, steps


def tokens(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_ids]


def test_greedy_output_is_identical_and_takes_fewer_steps(runner: ModelRunner, prompts: list[list[int]]) -> None:
    for ids in prompts:                        # one stream at a time: the case speculation is for
        params = SamplingParams(max_tokens=64)
        plain, _, plain_steps = generate(runner, None, [ids], params)
        spec, engine, spec_steps = generate(runner, ON, [ids], params)
        assert tokens(spec["0"]) == tokens(plain["0"])
        assert spec["0"][-1].finish_reason == plain["0"][-1].finish_reason
        assert spec["0"][-1].completion_tokens == plain["0"][-1].completion_tokens
        assert engine.stats.accepted_tokens > 0 and spec_steps < plain_steps
        assert engine.stats.accepted_tokens <= engine.stats.draft_tokens
        assert any(len(o.new_ids) > 1 for o in spec["0"])       # a step that yielded several tokens


def test_seeded_sampling_draws_the_same_tokens(runner: ModelRunner, prompts: list[list[int]]) -> None:
    """Each row is sampled with its position's generator, as without drafts: the same seed, the same text."""
    accepted = 0
    for seed in (1, 2, 3):
        params = SamplingParams(max_tokens=48, temperature=0.7, top_p=0.95, seed=seed)
        plain, _, _ = generate(runner, None, prompts[:1], params)
        spec, engine, _ = generate(runner, ON, prompts[:1], params)
        assert tokens(spec["0"]) == tokens(plain["0"]), f"seed {seed}"
        accepted += engine.stats.accepted_tokens
    assert accepted > 0


def test_two_streams_share_the_row_budget_and_keep_their_output(runner: ModelRunner,
                                                                prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain, _, _ = generate(runner, None, prompts, params)
    spec, engine, _ = generate(runner, ON, prompts, params)
    assert {k: tokens(v) for k, v in spec.items()} == {k: tokens(v) for k, v in plain.items()}
    assert all(len(tokens(v)) == 40 and v[-1].finish_reason is FinishReason.LENGTH for v in spec.values())
    assert engine.stats.draft_tokens > 0


def test_logprobs_and_max_tokens_with_drafts(runner: ModelRunner, prompts: list[list[int]]) -> None:
    """Every accepted token gets its logprob; drafts never run past max_tokens."""
    for max_tokens in (1, 2, 7):
        params = SamplingParams(max_tokens=max_tokens, logprobs=True, top_logprobs=2, ignore_eos=True)
        plain, _, _ = generate(runner, None, prompts[1:], params)
        spec, _, _ = generate(runner, ON, prompts[1:], params)
        assert tokens(spec["0"]) == tokens(plain["0"]) and len(tokens(spec["0"])) == max_tokens
        got = [lp for o in spec["0"] for lp in o.logprobs]
        want = [lp for o in plain["0"] for lp in o.logprobs]
        assert [lp.token_id for lp in got] == tokens(spec["0"])
        assert all(abs(a.logprob - b.logprob) < 1e-4 and len(a.top) == 2 for a, b in zip(got, want, strict=True))
