"""Prompt logprobs (completions' echo with logprobs) on the real model, against transformers' own."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from services.engine.core.request import SamplingParams
from services.engine.core.scheduler import SchedulerConfig
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide
from tests.service.test_engine import run, tokens


def test_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(model_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = hf
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it runs into the forest to "
                           "find its friends, who are waiting by the old oak tree near the river.")
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    runner = ModelRunner(model_dir, decide(device="cpu", dtype="float32"))
    engine = Engine(runner, scheduler=SchedulerConfig(max_batched_tokens=16))     # chunked prefill
    plain = engine.make_request("plain", ids, SamplingParams(max_tokens=3))
    run(engine, plain)                              # the prompt's blocks are now in the prefix cache
    req = engine.make_request("echo", ids, SamplingParams(max_tokens=3, logprobs=True, top_logprobs=2,
                                                          prompt_logprobs=True))
    outs = run(engine, req)["echo"]
    prompt = outs[0].prompt_logprobs
    assert [e.token_id for e in prompt] == ids and math.isnan(prompt[0].logprob)
    for k in range(1, len(ids)):
        assert abs(prompt[k].logprob - float(ref[k - 1, ids[k]])) < 1e-3, k
        assert [t for t, _ in prompt[k].top] == torch.topk(ref[k - 1], 2).indices.tolist()
    assert all(not o.prompt_logprobs for o in outs[1:])
    assert outs[-1].cached_tokens == 0                 # computed whole, though the cache held the prompt
    assert tokens(outs) == tokens(run(engine, engine.make_request("again", ids, SamplingParams(max_tokens=3)))["again"])
