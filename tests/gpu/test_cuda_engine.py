"""The engine's CUDA path: graph replay against eager steps, no host sync inside a step, pinned KV copies.

Skipped where torch sees no CUDA device (CI, this project's CPU machines); bench/gpu_check.py runs
the same checks and the throughput table on a lent GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU; none here (bench/gpu_check.py runs these checks on a lent GPU)"),
]

from services.engine.core.request import SamplingParams  # noqa: E402
from services.engine.core.scheduler import SchedulerConfig  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.engine.runtime import kv_transfer  # noqa: E402
from services.engine.runtime.model_runner import ModelRunner  # noqa: E402
from services.engine.runtime.plan import decide  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    config.save_pretrained(folder)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


def runner(tiny: tuple[Path, dict[str, torch.Tensor]], graphs: str, dtype: str = "float32") -> ModelRunner:
    folder, weights = tiny
    return ModelRunner(folder, decide(device="cuda", dtype=dtype, graphs=graphs, matmul="exact"),
                       kv_cache_bytes=32 << 20, block_size=16, max_batch=8, weights=weights)


def generate(r: ModelRunner, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    engine = Engine(r, scheduler=SchedulerConfig(max_batched_tokens=64, max_running=8))
    for i, p in enumerate(prompts):
        engine.add(engine.make_request(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True)))
    return {rid: [t for o in outs for t in o.new_ids] for rid, outs in engine.run_until_idle().items()}


PROMPTS = [[5, 9, 100], list(range(1, 40)), [7] * 17, list(range(200, 216))]


def test_graph_replay_equals_eager_steps(tiny: tuple[Path, dict[str, torch.Tensor]]) -> None:
    graphed, eager = runner(tiny, "cuda"), runner(tiny, "off")
    assert graphed.graphs is not None and graphed.graphs.graphs      # captured
    assert generate(graphed, PROMPTS, 12) == generate(eager, PROMPTS, 12)
    assert graphed.graphs.replays > 0


def test_a_step_queues_its_work_without_a_host_sync(tiny: tuple[Path, dict[str, torch.Tensor]]) -> None:
    r = runner(tiny, "cuda", "bfloat16")
    generate(r, PROMPTS, 3)                                             # warm up
    launch = r.launch

    def strict(chunks, greedy=False):  # type: ignore[no-untyped-def]
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(chunks, greedy)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    r.launch = strict  # type: ignore[method-assign]
    assert all(len(t) == 5 for t in generate(r, PROMPTS, 5).values())


def test_kv_blocks_move_through_pinned_memory(tiny: tuple[Path, dict[str, torch.Tensor]]) -> None:
    r = runner(tiny, "off", "bfloat16")
    for k, v in r.kv:
        k.normal_()
        v.normal_()
    exported = kv_transfer.export_blocks_async(r.kv, [3, 1])
    assert exported.kv.is_pinned() and exported.ready is not None
    host = exported.wait()
    lay = kv_transfer.layout(r.kv)
    fetched = kv_transfer.from_bytes([kv_transfer.to_bytes(b) for b in host], lay, pin=True)
    assert fetched.is_pinned() and torch.equal(fetched, host)
    kv_transfer.import_blocks(r.kv, [(5, fetched[0]), (6, fetched[1])])
    for k, v in r.kv:
        assert torch.equal(k[5], k[3]) and torch.equal(v[6], v[1])


def test_triton_decode_matches_torch_on_cuda() -> None:
    from meshkernels import paged_attention, paged_attention_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(64, 16, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(64, 16, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    q = torch.randn(3, 32, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    tables = torch.tensor([[5, 9, 2, 5], [1, 1, 1, 1], [60, 61, 62, 63]], device="cuda")
    lens = torch.tensor([40, 1, 64], device="cuda")
    got = paged_attention_triton.decode(q, k, v, tables, lens, 0.125)
    want = paged_attention.decode(q.float(), k.float(), v.float(), tables, lens, 0.125)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
