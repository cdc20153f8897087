"""Embeddings in the engine (SamplingParams.pooling): the prompt's final hidden states pooled as
transformers' own model gives them, whole or in prefill chunks, beside a request that generates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mesh.errors import InvalidArgument
from services.engine.core.request import SamplingParams
from services.engine.core.scheduler import SchedulerConfig
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner, pooled_positions
from services.engine.runtime.plan import decide

TEXTS = ["The cat sat on the mat.", "Quarterly revenue grew by twelve percent, driven by cloud services."]


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, decide(device="cpu", dtype="float32"), kv_cache_bytes=64 << 20)


def hidden_states(hf, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' last hidden state (after the final norm) of each prompt token."""
    model, _ = hf
    with torch.inference_mode():
        return model.model(torch.tensor([ids])).last_hidden_state[0].float()


def embed(engine: Engine, prompts: list[list[int]], pooling: str) -> list[torch.Tensor]:
    for i, ids in enumerate(prompts):
        engine.add(engine.make_request(f"e{i}", ids, SamplingParams(max_tokens=1, pooling=pooling)))
    outs = engine.run_until_idle()
    return [torch.tensor(outs[f"e{i}"][-1].embedding) for i in range(len(prompts))]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max())))


def test_pooled_hidden_states_equal_transformers(runner: ModelRunner, hf) -> None:  # type: ignore[no-untyped-def]
    _, tokenizer = hf
    prompts = [tokenizer.encode(t) for t in TEXTS]
    for pooling, pick in (("mean", lambda h: h.mean(0)), ("cls", lambda h: h[0]), ("last", lambda h: h[-1])):
        got = embed(Engine(runner), prompts, pooling)          # both prompts in one step
        for ids, vector in zip(prompts, got, strict=True):
            assert vector.shape == (runner.config.hidden_size,)
            assert close(vector, pick(hidden_states(hf, ids))), pooling
    # "model": a model without a sentence-transformers pooling config pools the mean.
    assert close(embed(Engine(runner), prompts[:1], "model")[0], hidden_states(hf, prompts[0]).mean(0))


def test_chunked_prefill_and_a_generating_neighbour_leave_the_vector_alone(runner: ModelRunner, hf) -> None:  # type: ignore[no-untyped-def]
    _, tokenizer = hf
    long = tokenizer.encode(" ".join(TEXTS * 6))                 # ~130 tokens, in chunks of 32
    engine = Engine(runner, scheduler=SchedulerConfig(max_batched_tokens=32))
    engine.add(engine.make_request("gen", tokenizer.encode("Count to five:"), SamplingParams(max_tokens=12)))
    engine.add(engine.make_request("emb", long, SamplingParams(max_tokens=1, pooling="mean")))
    outs = engine.run_until_idle()
    assert len(outs["emb"]) == 1 and outs["emb"][-1].prompt_tokens == len(long)
    assert close(torch.tensor(outs["emb"][-1].embedding), hidden_states(hf, long).mean(0))
    assert sum(len(o.new_ids) for o in outs["gen"]) == 12 and not outs["gen"][-1].embedding
    # Twice the same prompt: the second is computed again (no prefix-cache hit), and equal.
    again = embed(engine, [long], "mean")[0]
    assert close(again, torch.tensor(outs["emb"][-1].embedding))


def test_pooled_positions_per_chunk() -> None:
    assert list(pooled_positions("mean", 0, 4, 10)) == [0, 1, 2, 3]
    assert list(pooled_positions("mean", 8, 4, 10)) == [8, 9]          # a chunk past the prompt's end
    assert list(pooled_positions("cls", 0, 4, 10)) == [0] and not pooled_positions("cls", 4, 4, 10)
    assert list(pooled_positions("last", 8, 2, 10)) == [9] and not pooled_positions("last", 0, 8, 10)


def test_an_unknown_pooling_is_refused() -> None:
    from mesh.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="pooling 'max' is not one of model, mean, cls, last"):
        SamplingParams(pooling="max")


def test_an_embedding_model_serves_embeddings_only(runner: ModelRunner, hf, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _, tokenizer = hf
    monkeypatch.setattr(runner, "task", "embed")                # as mesh.models.task_of says of its folder
    engine = Engine(runner)
    with pytest.raises(InvalidArgument, match="is an embedding model: it serves embeddings only"):
        engine.make_request("gen", tokenizer.encode("Count to five:"), SamplingParams(max_tokens=4))
    assert embed(engine, [tokenizer.encode(TEXTS[0])], "mean")[0].shape == (runner.config.hidden_size,)
