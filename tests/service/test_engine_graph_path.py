"""The decode-graph path end to end on a tiny random Llama: the engine with the Triton decode kernel
(Triton's interpreter on this CPU) and the graphs' padded static buffers ("eager": no capture)
gives the tokens of the plain torch path and of transformers' generate; padded rows write only
the scratch block; sampled and logprob requests agree with the graphs off; weights passed as a
state dict equal the folder's."""

from __future__ import annotations

import json
import os

# Triton reads this when a kernel is defined: run kernels in its interpreter on this CPU-only machine.
os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from mesh.models import eos_token_ids
from services.engine.core.request import FinishReason, Request, SamplingParams, StepOutput
from services.engine.core.scheduler import SchedulerConfig
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide
from tests.service.test_engine import run, tokens

pytestmark = pytest.mark.slow      # the Triton kernels through Triton's interpreter (make test-fast leaves them out)

BLOCK = 4
KV_BLOCKS = 96
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4      # (K, V) x layers x slots x KV heads x head size x fp32
EOS = (2, 3)


@dataclass(frozen=True)
class Tiny:
    folder: Path
    model: Any                       # transformers' LlamaForCausalLM, the same weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """2 layers, 4 heads over 2 KV heads of 16; weights 10x transformers' default scale, so the
    greedy choice is decisive (top-2 logit gaps far above float32 rounding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": list(EOS)}))
    model.generation_config.eos_token_id = None      # transformers: never stop early (the engine ignores EOS)
    return Tiny(folder, model)


def runner(tiny: Tiny, attention: str, graphs: str, **kwargs: object) -> ModelRunner:
    r = ModelRunner(tiny.folder, decide(device="cpu", dtype="float32", attention=attention, graphs=graphs),
                    kv_cache_bytes=KV_BLOCKS * BLOCK_BYTES, block_size=BLOCK, **kwargs)  # type: ignore[arg-type]
    assert r.block_bytes == BLOCK_BYTES and r.num_blocks == KV_BLOCKS
    return r


# Six prompts: ragged lengths (a block boundary among them); the two joining late share full
# blocks with early ones, which by then are in the prefix cache.
_g = torch.Generator().manual_seed(1)
_A, _B, _C, _D = (torch.randint(4, 512, (16,), generator=_g).tolist() for _ in range(4))
EARLY = [_A[:3], _B[:4], _A[:9], _C[:13]]
LATE = [_A[:8] + _D[:9], _B[:5]]
PROMPTS = EARLY + LATE
# Different lengths, so the batch shrinks 6, 5, 4, 3, 2, 1 and crosses every bucket of max_batch=8.
MAX_TOKENS = [14, 4, 8, 11, 9, 6]


def requests(engine: Engine, params: Callable[[int], SamplingParams] | None = None) -> list[Request]:
    return [engine.make_request(f"r{i}", ids, params(i) if params else
                                SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True))
            for i, ids in enumerate(PROMPTS)]


def drive(engine: Engine, reqs: list[Request], after_step: Callable[[], None] = lambda: None
          ) -> dict[str, list[StepOutput]]:
    """The early requests prefill together; the late ones join the running batch at the next step."""
    outputs: dict[str, list[StepOutput]] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        after_step()

    for req in reqs[:len(EARLY)]:
        engine.add(req)
    step()
    for req in reqs[len(EARLY):]:
        engine.add(req)
    while engine.has_work():
        step()
    return outputs


@dataclass
class GraphRun:
    runner: ModelRunner
    tokens: dict[str, list[int]]
    batches: list[tuple[int, int]] = field(default_factory=list)          # (rows, bucket) per graph step
    handed_out: set[int] = field(default_factory=set)                      # every block ever allocated
    dirty_free_blocks: list[tuple[int, int]] = field(default_factory=list)  # (step, block) never allocated
    scratch_written: bool = False


@pytest.fixture(scope="module")
def graph_run(tiny: Tiny) -> GraphRun:
    """The scenario with the Triton kernel on the eager graph path, watched step by step."""
    r = runner(tiny, "triton", "eager", max_batch=8)
    assert r.graphs is not None and r.graphs.sizes == [1, 2, 4, 8]
    engine = Engine(r)
    result = GraphRun(r, {})
    bucket, new_block = r.graphs.bucket, engine.blocks._new_block

    def watched_bucket(n: int) -> int:          # called once per graph step
        size = bucket(n)
        result.batches.append((n, size))
        return size

    def watched_new_block() -> int:
        block = new_block()
        result.handed_out.add(block)
        return block

    r.graphs.bucket = watched_bucket           # type: ignore[method-assign]
    engine.blocks._new_block = watched_new_block  # type: ignore[method-assign]
    steps = 0

    def check_blocks() -> None:
        nonlocal steps
        steps += 1
        for k, v in r.kv:
            written = (k.flatten(1) != 0).any(dim=1) | (v.flatten(1) != 0).any(dim=1)   # (blocks + 1,)
            for block in written.nonzero().flatten().tolist():
                if block == r.scratch_block:
                    result.scratch_written = True
                elif block not in result.handed_out:
                    result.dirty_free_blocks.append((steps, block))

    outputs = drive(engine, requests(engine), check_blocks)
    result.tokens = {rid: tokens(outs) for rid, outs in outputs.items()}
    assert all(outs[-1].finish_reason is FinishReason.LENGTH for outs in outputs.values())
    assert engine.blocks.num_used_blocks == 0
    return result


@pytest.fixture(scope="module")
def torch_tokens(tiny: Tiny) -> dict[str, list[int]]:
    engine = Engine(runner(tiny, "torch", "off"))
    return {rid: tokens(outs) for rid, outs in drive(engine, requests(engine)).items()}


@pytest.fixture(scope="module")
def hf_tokens(tiny: Tiny) -> dict[str, list[int]]:
    out = {}
    with torch.inference_mode():
        for i, ids in enumerate(PROMPTS):
            seq = tiny.model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS[i], do_sample=False)
            out[f"r{i}"] = seq[0, len(ids):].tolist()
    return out


def test_folder_declares_its_end_of_sequence_ids(tiny: Tiny) -> None:
    assert eos_token_ids(tiny.folder) == frozenset(EOS)
    plan = decide(device="cpu", dtype="float32", graphs="off")
    assert ModelRunner(tiny.folder, plan, kv_cache_bytes=1 << 16).eos_token_ids == frozenset(EOS)


def test_greedy_tokens_equal_torch_path_and_transformers(graph_run: GraphRun, torch_tokens: dict[str, list[int]],
                                                         hf_tokens: dict[str, list[int]]) -> None:
    assert {rid: len(t) for rid, t in hf_tokens.items()} == {f"r{i}": n for i, n in enumerate(MAX_TOKENS)}
    assert torch_tokens == hf_tokens
    assert graph_run.tokens == hf_tokens
    # Not a degenerate model: the tokens vary.
    assert len({t for ts in hf_tokens.values() for t in ts}) > 10


def test_pure_decode_steps_replay_every_bucket(graph_run: GraphRun) -> None:
    graphs = graph_run.runner.graphs
    assert graphs is not None and not graphs.graphs          # eager: nothing captured
    assert graphs.replays == len(graph_run.batches) > 0
    # Steps 1 and 2 had prefill chunks and ran outside the graphs; from step 3 on every step is pure
    # decode, the batch shrinking as requests reach their max_tokens (r0 takes 14 steps in all).
    assert [n for n, _ in graph_run.batches] == [6, 6, 5, 5, 5, 4, 3, 3, 2, 1, 1, 1]
    assert [bucket for _, bucket in graph_run.batches] == [8, 8, 8, 8, 8, 4, 4, 4, 2, 1, 1, 1]


def test_padding_rows_write_only_the_scratch_block(graph_run: GraphRun) -> None:
    assert any(n < bucket for n, bucket in graph_run.batches), "no padded step: the check proved nothing"
    assert len(graph_run.handed_out) < KV_BLOCKS             # some blocks were never handed out
    assert graph_run.dirty_free_blocks == []                 # (step, block): written, never handed out
    assert graph_run.runner.scratch_block not in graph_run.handed_out
    assert graph_run.scratch_written                         # the padding rows' K/V went there


SAMPLED_MAX_TOKENS = [n // 2 + 1 for n in MAX_TOKENS]     # shorter: the interpreter runs both paths


def sampled_params(i: int) -> SamplingParams:
    """Seeded sampling, greedy with logprobs, and seeded sampling with logprobs in the same batches."""
    n = SAMPLED_MAX_TOKENS[i]
    if i % 3 == 0:
        return SamplingParams(temperature=0.9, top_k=40, seed=100 + i, max_tokens=n, ignore_eos=True)
    if i % 3 == 1:
        return SamplingParams(logprobs=True, top_logprobs=3, max_tokens=n, ignore_eos=True)
    return SamplingParams(temperature=1.2, top_p=0.9, seed=7, logprobs=True, max_tokens=n, ignore_eos=True)


def test_sampled_and_logprob_requests_agree_with_graphs_off(tiny: Tiny) -> None:
    def generate(graphs: str) -> tuple[dict[str, list[StepOutput]], ModelRunner]:
        r = runner(tiny, "triton", graphs, max_batch=8)
        engine = Engine(r)
        return drive(engine, requests(engine, sampled_params)), r

    eager, r = generate("eager")
    assert r.graphs is not None and r.graphs.replays > 0
    off, _ = generate("off")
    assert {rid: tokens(o) for rid, o in eager.items()} == {rid: tokens(o) for rid, o in off.items()}
    for rid, outs in eager.items():
        got = [(lp.token_id, lp.logprob, [t for t, _ in lp.top]) for o in outs for lp in o.logprobs]
        want = [(lp.token_id, lp.logprob, [t for t, _ in lp.top]) for o in off[rid] for lp in o.logprobs]
        assert [g[0] for g in got] == [w[0] for w in want] and [g[2] for g in got] == [w[2] for w in want]
        # A padded batch runs other GEMM shapes: equal to rounding, not bit for bit.
        assert [g[1] for g in got] == pytest.approx([w[1] for w in want], abs=1e-4)
    assert sum(len(o.logprobs) for outs in eager.values() for o in outs) == sum(
        SAMPLED_MAX_TOKENS[i] for i in range(len(PROMPTS)) if i % 3)


def test_weights_from_a_state_dict_equal_the_folders(tiny: Tiny, tmp_path: Path,
                                                     torch_tokens: dict[str, list[int]]) -> None:
    """Only config.json and the end-of-sequence ids come from the folder: it holds no weights here."""
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny.folder / name, tmp_path / name)
    weights = {name: t.detach().clone() for name, t in tiny.model.state_dict().items()}
    r = ModelRunner(tmp_path, decide(device="cpu", dtype="float32", attention="torch", graphs="off"),
                    kv_cache_bytes=KV_BLOCKS * BLOCK_BYTES, block_size=BLOCK, weights=weights)
    assert r.eos_token_ids == frozenset(EOS)
    engine = Engine(r)
    assert {rid: tokens(outs) for rid, outs in drive(engine, requests(engine)).items()} == torch_tokens


def test_one_token_prefill_chunks_stay_off_the_graph_path(tiny: Tiny) -> None:
    """A budget of one token per step: every chunk after the first is one token at start > 0, and
    all but the prompt's last sample nothing.  Those take the plain path (the graphs return a row
    for every chunk); the prompt's last token and the decodes take the graphs; same tokens."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    budget = SchedulerConfig(max_batched_tokens=1)
    want = run(Engine(runner(tiny, "torch", "off"), scheduler=budget), Request("a", PROMPTS[2], params, 3))
    eager = runner(tiny, "torch", "eager", max_batch=2)
    got = run(Engine(eager, scheduler=budget), Request("a", PROMPTS[2], params, 3))
    assert tokens(got["a"]) == tokens(want["a"]) and len(tokens(got["a"])) == 3
    assert eager.graphs is not None and eager.graphs.replays == 3
