"""GGUF import beyond the default model: a tiny Llama written as llama.cpp lays a GGUF out (F16, Q8_0,
Q4_0, Q4_1 and Q4_K tensors; tests/service/gguf_files.py), registered by `infermesh model register NAME
FILE.gguf`, which keeps the file's blocks (model.gguf in the folder, nothing de-quantized on disk): the
weights the engine reads come back within the format's rounding (names and q/k row order right) and
equal to transformers' own GGUF reader's, the engine's float32 greedy output equals transformers' on the
same file, the q4 plan re-packs the blocks exactly representable in its formats, and the gguf plan
multiplies by the file's own blocks where the kernel has their type."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mesh.models.gguf import load_gguf_model
from services.engine.core.request import SamplingParams
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.models.config import load_weights
from services.engine.runtime.models.gguf_weights import dense
from services.engine.runtime.models.linear import Fp16WeightLinear, GgufLinear, Q4Linear, Q8LayerLinear
from services.engine.runtime.plan import decide
from tests.service.gguf_files import Field, tokenizer_fields, write_llama_gguf

VOCAB = 1024                    # the default model's first tokens: tokenizer_fields
# Rounding of each format: the largest weight error allowed, as a share of the tensor's largest |weight|.  The
# formats' bounds: F16 2^-11; Q8_0 half a step, 1/254, plus its fp16 scale's rounding; Q4_0 a whole step, 1/8
# (q = w / d + 8 clips at 15 on the largest weight's side); Q4_1 half a step, up to 1/15; Q4_K about that
# plus its 6-bit scales' rounding.  Measured here: 0.0004, 0.0040, 0.094, 0.053, 0.053.
TOLERANCE = {"F16": 1 / 1024, "Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 1 / 14, "Q4_K": 1 / 12}


@pytest.fixture(scope="module")
def tiny() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.05, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> list[Field]:
    return tokenizer_fields(model_dir / "model.gguf", VOCAB)


@pytest.mark.slow                    # writes a GGUF per type and imports it, as `model pull` (also slow) does
@pytest.mark.parametrize("qtype", sorted(TOLERANCE))
def test_register_a_gguf_file(qtype: str, tiny: Any, tokenizer: list[Field], tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_0 goes through the CLI (`register`, then `inspect`); the others through the same function in
    process (the CLI's cost is importing torch twice)."""
    from infermesh.cli import engine_check
    from mesh import models

    gguf_file = tmp_path / f"tiny-{qtype}.gguf"
    write_llama_gguf(tiny, gguf_file, qtype, tokenizer, embed_qtype="Q8_0" if qtype == "Q8_0" else "F16")
    env = {**os.environ, "INFERMESH_HOME": str(tmp_path / "home")}
    cli = qtype == "Q4_0"
    if cli:
        done = subprocess.run([sys.executable, "-m", "infermesh.cli", "model", "register", "tiny", str(gguf_file)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        folder = Path(done.stdout.strip().splitlines()[-1])
    else:
        monkeypatch.setenv("INFERMESH_HOME", str(tmp_path / "home"))
        folder = models.import_gguf("tiny", gguf_file, progress=lambda _: None, check=engine_check)
        assert models.path("tiny") == folder
    assert folder.parent == tmp_path / "home" / "models"

    assert (folder / "model.gguf").is_file() and not list(folder.glob("*.safetensors"))
    converted, _ = load_gguf_model(folder / "model.gguf")        # transformers' own reader of the same file
    converted.eval()
    ours = load_weights(folder)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight"):
        original = tiny.state_dict()[name]
        error = (converted.state_dict()[name] - original).abs().max().item() / original.abs().max().item()
        print(f"{qtype} {name}: largest error {error:.5f} of the largest weight")
        assert error <= TOLERANCE[qtype], f"{name}: {error}"
    for name, weight in ours.items():
        assert torch.equal(dense(weight), converted.state_dict()[name]), name

    prompts = [torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 23)]
    runner = ModelRunner(folder, decide(device="cpu", dtype="float32"), kv_cache_bytes=16 << 20)
    engine = Engine(runner)
    for i, prompt in enumerate(prompts):
        engine.add(engine.make_request(str(i), prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    got = {rid: [t for out in outs for t in out.new_ids] for rid, outs in engine.run_until_idle().items()}
    converted.generation_config.eos_token_id = None
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            want = converted.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
        assert got[str(i)] == want.tolist()

    # The q4 plan keeps the file's own blocks where our formats hold them exactly.
    fast = ModelRunner(folder, decide(device="cpu", dtype="float32", matmul="q4"), kv_cache_bytes=16 << 20)
    down = fast.model.layers[0].down
    assert isinstance(down, Q4Linear)
    if qtype in ("Q4_0", "Q4_1"):
        assert down.lossless                                    # 4-bit blocks, the one-call decoder layer too
        assert fast.model.fused_layers is not None or fast.plan.attention != "fused"
    elif qtype == "Q8_0":
        assert isinstance(down.fallback, Q8LayerLinear) and down.fallback.lossless
    else:                                                       # F16 (exact in fp16w), Q4_K (fp16-rounded)
        assert isinstance(down.fallback, Q8LayerLinear) and isinstance(down.fallback.fallback, Fp16WeightLinear)

    # The gguf plan multiplies by the file's blocks where the kernel has their type, the rest de-quantized.
    blocks = ModelRunner(folder, decide(device="cpu", dtype="float32", matmul="gguf"), kv_cache_bytes=16 << 20)
    down = blocks.model.layers[0].down
    assert isinstance(down, GgufLinear)
    assert (down.kind is not None) == _kernel_has(qtype), (qtype, down.kind)
    hidden = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    want = hidden @ dense(ours["model.layers.0.mlp.down_proj.weight"]).T
    assert (down(hidden) - want).abs().max() <= 0.02 * want.abs().max()
    if _kernel_has(qtype) and blocks.plan.attention == "fused":
        # Decode steps run each layer as one call (decode_layer_gguf): the op-by-op forward's numbers exactly.
        assert blocks.model.fused_layers is not None and blocks.model.fused_op == "decode_layer_gguf"
        fused = _generate(blocks, prompts)
        op_by_op = ModelRunner(folder, decide(device="cpu", dtype="float32", matmul="gguf"), kv_cache_bytes=16 << 20)
        op_by_op.model.fused_layers = None
        assert _generate(op_by_op, prompts) == fused
        # ggufr, the blocks repacked 16 rows at a time: its one call per layer is its op-by-op forward exactly
        repacked = ModelRunner(folder, decide(device="cpu", dtype="float32", matmul="ggufr"), kv_cache_bytes=16 << 20)
        assert repacked.model.fused_layers is not None and repacked.model.layers[0].down.kind >= 256
        assert (repacked.model.layers[0].down(hidden) - want).abs().max() <= 0.02 * want.abs().max()
        fused_r = _generate(repacked, prompts)
        repacked.model.fused_layers = None
        assert _generate(repacked, prompts) == fused_r

    if cli:
        shown = subprocess.run([sys.executable, "-m", "infermesh.cli", "model", "inspect", "tiny"], env=env,
                               capture_output=True, text=True, timeout=300)
        assert shown.returncode == 0 and f"{qtype} x" in shown.stdout, shown.stdout + shown.stderr
    else:
        assert f"{qtype} x" in models.describe_folder(folder)["quantization"]


def _kernel_has(qtype: str) -> bool:
    """Whether gguf_linear multiplies blocks of this GGUF type (F16 is no block type)."""
    from gguf import GGMLQuantizationType

    from meshkernels import gguf_blocks

    try:
        return gguf_blocks.kind_of(GGMLQuantizationType[qtype]) is not None
    except ValueError:
        return False


def _generate(runner: ModelRunner, prompts: list[list[int]]) -> dict[str, list[tuple[int, float]]]:
    """Each prompt's 8 greedy tokens with their log-probs."""
    engine = Engine(runner)
    for i, prompt in enumerate(prompts):
        engine.add(engine.make_request(str(i), prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)))
    return {rid: [(lp.token_id, lp.logprob) for out in outs for lp in out.logprobs]
            for rid, outs in engine.run_until_idle().items()}
