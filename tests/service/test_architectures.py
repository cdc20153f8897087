"""Architectures and RoPE variants beyond SmolLM2, on tiny random-weight models that transformers builds
from a config (offline): greedy output equal to transformers' `generate` in the float32 mode, ragged
prompts run together, and within rounding in the fused CPU mode.

Covered here: Llama with linear, llama3 and yarn RoPE scaling (a short original context, so scaling
changes the frequencies that matter); Qwen2 (q/k/v biases); Qwen3 (per-head q/k RMSNorm, explicit
head_dim); Gemma 2 and Gemma 3 (see their cases); Phi-3 (fused projections); Mistral with
a sliding window shorter than the prompts (prefill, chunked prefill and decode each honour it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mesh.errors import InvalidArgument
from services.engine.core.request import SamplingParams
from services.engine.core.scheduler import SchedulerConfig
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.models.config import LlamaConfig as OurConfig
from services.engine.runtime.plan import decide

pytestmark = pytest.mark.slow            # a model of every architecture built and run (make test-fast leaves them out)

COMMON = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "initializer_range": 0.2, "tie_word_embeddings": False}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    "llama3": ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                             "rope_theta": 500000.0}}),
    "llama-yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 8.0,
                                                 "original_max_position_embeddings": 32, "rope_theta": 10000.0}}),
    "qwen2": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "qwen3": ("qwen3", {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "mistral-window": ("mistral", {"sliding_window": 12, "head_dim": 16}),
    # Gemma 3: alternating local (window 12, theta 10k) and global (theta 1M, linear x4) layers, (1 + w)
    # norms around both blocks, q/k norms, GELU, scaled embeddings, query_pre_attn_scalar.
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": 12, "query_pre_attn_scalar": 24,
                               "layer_types": ["sliding_attention", "full_attention"],
                               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                      "rope_theta": 1000000.0}}}),
    # Gemma 2: Gemma 3's layout (local layers first) without q/k norms, one RoPE, and soft-capping tight enough
    # to bite: attention scores capped at 5 and final logits at 3, where these weights put them far past.
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": 12, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "initializer_range": 0.4}),
    "phi3": ("phi3", {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}),   # fused qkv_proj, gate_up_proj
}
_g = torch.Generator().manual_seed(3)
PROMPTS = [torch.randint(4, 512, (n,), generator=_g).tolist() for n in (5, 17, 30, 9)]
NEW = 24


def build(kind: str, extra: dict[str, Any], folder: Path) -> Any:
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
                  "gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig,
                  "phi3": transformers.Phi3Config}[kind]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "gemma2": transformers.Gemma2ForCausalLM, "gemma3_text": transformers.Gemma3ForCausalLM,
                 "phi3": transformers.Phi3ForCausalLM}[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():    # norms away from their init (1, or Gemma's 0): every block's output matters
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn(param.shape) * 0.5 + (3.0 if "post_" in name and kind.startswith("gemma")
                                                                else 0.0))
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    kind, extra = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, build(kind, extra, folder)


def reference(model: Any, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def generate(runner: ModelRunner, budget: int = 512) -> dict[str, list[int]]:
    engine = Engine(runner, scheduler=SchedulerConfig(max_batched_tokens=budget))
    for i, prompt in enumerate(PROMPTS):
        engine.add(engine.make_request(str(i), prompt, SamplingParams(max_tokens=NEW, ignore_eos=True)))
    return {rid: [t for out in outs for t in out.new_ids] for rid, outs in engine.run_until_idle().items()}


def test_the_config_is_read_as_transformers_reads_it(case: tuple[str, Path, Any]) -> None:
    name, folder, _ = case
    config = OurConfig.from_folder(folder)
    assert config.qk_norm == (name in ("qwen3", "gemma3"))
    assert config.windows == {"mistral-window": (12, 12), "gemma2": (12, 0), "gemma3": (12, 0)}.get(name, ())
    assert (config.attn_softcap, config.final_softcap) == ((5.0, 3.0) if name == "gemma2" else (0.0, 0.0))
    if name == "gemma2":
        assert config.norm_offset == 1.0 and config.sandwich_norms and config.activation == "gelu_tanh"
        assert config.attn_scale == 24 ** -0.5 and config.embed_scale == 64 ** 0.5 and not config.layer_rope
    elif name == "gemma3":
        assert config.norm_offset == 1.0 and config.sandwich_norms and config.activation == "gelu_tanh"
        assert [dict(r)["rope_theta"] for r in config.layer_rope] == [10000.0, 1000000.0]
        assert config.attn_scale == 24 ** -0.5 and config.embed_scale == 64 ** 0.5
    else:
        assert dict(config.rope_scaling).get("rope_type", "default") == CASES[name][1].get(
            "rope_parameters", {}).get("rope_type", "default")


@pytest.mark.parametrize("budget", [512, 8])    # 8: prompts prefill in chunks that read the cache
def test_float32_greedy_equals_transformers(case: tuple[str, Path, Any], budget: int) -> None:
    _, folder, model = case
    runner = ModelRunner(folder, decide(device="cpu", dtype="float32"), kv_cache_bytes=8 << 20, block_size=4)
    got = generate(runner, budget)
    for i, prompt in enumerate(PROMPTS):
        assert got[str(i)] == reference(model, prompt), f"prompt {i} ({len(prompt)} tokens)"


def test_the_fused_cpu_mode_agrees(case: tuple[str, Path, Any]) -> None:
    """packed fp32 GEMMs with the fused CPU ops (decode attention with its window) and a float32 KV cache:
    the same greedy tokens as transformers on these decisive random weights."""
    _, folder, model = case
    plan = decide(device="cpu", dtype="float32", matmul="packed", kv_dtype="float32")
    if plan.attention != "fused":
        pytest.skip("the fused CPU ops are off")
    got = generate(ModelRunner(folder, plan, kv_cache_bytes=8 << 20, block_size=4))
    for i, prompt in enumerate(PROMPTS):
        assert got[str(i)] == reference(model, prompt), f"prompt {i}"


def test_unsupported_rope_is_refused_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", **COMMON, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}))
    with pytest.raises(ValueError, match="rope_parameters.rope_type 'longrope' is not supported"):
        OurConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", **COMMON, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}))
    with pytest.raises(ValueError, match="lacks low_freq_factor, high_freq_factor"):
        OurConfig.from_folder(tmp_path)


def test_a_gemma2_config_that_leaves_fields_out_is_read_with_transformers_defaults(tmp_path: Path) -> None:
    """Gemma 2 checkpoints' config.json predate `layer_types` and may omit what Gemma2Config defaults (the
    caps, query_pre_attn_scalar, head_dim, the window): read as transformers reads them."""
    import transformers

    fields = {**{k: v for k, v in COMMON.items() if k != "tie_word_embeddings"}, "model_type": "gemma2",
              "num_hidden_layers": 3}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    config = OurConfig.from_folder(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert theirs.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.windows == (theirs.sliding_window, 0, theirs.sliding_window)
    assert (config.attn_softcap, config.final_softcap) == (theirs.attn_logit_softcapping,
                                                           theirs.final_logit_softcapping)
    assert config.head_dim == theirs.head_dim and config.attn_scale == theirs.query_pre_attn_scalar ** -0.5
    assert config.tie_word_embeddings and config.activation == "gelu_tanh" and not config.qk_norm
    # A cap set to null is off, as in transformers; a non-Gemma type with a cap is refused.
    (tmp_path / "config.json").write_text(json.dumps({**fields, "attn_logit_softcapping": None}))
    assert OurConfig.from_folder(tmp_path).attn_softcap == 0.0
    (tmp_path / "config.json").write_text(json.dumps({**fields, "model_type": "llama", "final_logit_softcapping": 30}))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        OurConfig.from_folder(tmp_path)


def test_a_32k_token_prompt_prefills_in_chunks_and_matches_transformers(tmp_path: Path) -> None:
    """A long-context config (32k + 64 positions): a 32,000-token prompt goes through chunked prefill (each
    chunk attending every earlier block of the paged cache) and its first tokens equal transformers'."""
    folder = tmp_path / "long"
    model = build("llama", {"max_position_embeddings": 32768 + 64,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, folder)
    prompt = torch.randint(4, 512, (32000,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, -4:].tolist()
    runner = ModelRunner(folder, decide(device="cpu", dtype="float32"), kv_cache_bytes=24 << 20)
    assert runner.num_blocks * runner.block_size >= 32004
    engine = Engine(runner, scheduler=SchedulerConfig(max_batched_tokens=2048))
    engine.add(engine.make_request("long", prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    got: list[int] = []
    steps = 0
    while engine.has_work():
        for out in engine.step():
            got += out.new_ids
        steps += 1
    assert got == want and steps >= 32000 // 2048
    # Beyond what the cache can ever hold: refused at once, naming the limit and the flag to raise.
    small = Engine(ModelRunner(folder, decide(device="cpu", dtype="float32"), kv_cache_bytes=4 << 20))
    with pytest.raises(InvalidArgument, match="can never fit this engine's KV cache.*--kv-cache-mb"):
        small.make_request("too-long", prompt, SamplingParams(max_tokens=4))


def test_model_register_checks_the_config_and_inspect_describes_the_model(tmp_path: Path) -> None:
    """`infermesh model register` refuses what the engine cannot run (naming the field) before it is
    registered; `infermesh model inspect` reads a registered model without loading it."""
    import os
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "gemma"
    kind, extra = CASES["gemma3"]
    build(kind, extra, folder)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    env = {**os.environ, "INFERMESH_HOME": str(tmp_path / "home")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "infermesh.cli", "model", *args], env=env, capture_output=True,
                              text=True, timeout=120)

    assert cli("register", "tiny-gemma", str(folder)).returncode == 0
    shown = cli("inspect", "tiny-gemma")
    assert shown.returncode == 0, shown.stderr
    lines = dict(line.split(":", 1) for line in shown.stdout.splitlines())
    params = sum(p.numel() for p in build(kind, extra, tmp_path / "again").parameters())
    assert lines["architecture"].strip() == "gemma3_text" and int(lines["parameters"]) == params
    assert lines["context"].strip() == "256" and lines["chat_template"].strip() == "True"
    assert lines["sliding_window"].strip() == "12" and "full_attention: linear" in lines["rope"]
    assert lines["engine"].strip().startswith("cpu float32")

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    config["use_bidirectional_attention"] = True
    (bad / "config.json").write_text(json.dumps(config))
    refused = cli("register", "bad", str(bad))
    assert refused.returncode == 1 and "use_bidirectional_attention" in refused.stderr
    assert "bad" not in cli("list").stdout


@pytest.mark.parametrize("matmul,tolerance", [("fp16w", 0.01), ("bf16w", 0.08)])
def test_fast_modes_keep_logprobs_within_a_stated_tolerance(case: tuple[str, Path, Any], matmul: str,
                                                            tolerance: float) -> None:
    """The CPU's fast kinds as auto runs them (fused ops, float16 KV cache): every generated token's logprob
    within `tolerance` of transformers' float32 logprob of the same token at the same place (measured on
    these models: fp16w <= 0.0023, bf16w <= 0.031)."""
    from services.engine.runtime.models.linear import native_bf16

    if matmul == "bf16w" and not native_bf16():
        pytest.skip("bf16w needs a CPU that multiplies bf16 natively")
    _, folder, model = case
    engine = Engine(ModelRunner(folder, decide(device="cpu", dtype="float32", matmul=matmul), kv_cache_bytes=8 << 20,
                                block_size=4))
    for i, prompt in enumerate(PROMPTS):
        engine.add(engine.make_request(str(i), prompt, SamplingParams(max_tokens=6, logprobs=True, ignore_eos=True)))
    got = {rid: [lp for out in outs for lp in out.logprobs] for rid, outs in engine.run_until_idle().items()}
    for i, prompt in enumerate(PROMPTS):
        ids = [lp.token_id for lp in got[str(i)]]
        with torch.inference_mode():
            reference_lp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
        for j, lp in enumerate(got[str(i)]):
            assert abs(reference_lp[len(prompt) - 1 + j, lp.token_id].item() - lp.logprob) < tolerance


def test_dynamic_ntk_rope_rotates_as_transformers_generate_does(tmp_path: Path) -> None:
    """Dynamic NTK past max_position_embeddings (64 here, factor 2): a 90-token prompt rotated at its own
    length, and a 40-token prompt whose answer crosses position 64, each token then at its p + 1;
    prompts together, prefilled in 16-token chunks, against transformers' generate on a fresh model each
    (its rotary state carries over between calls)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "dynamic"
    build("llama", {"max_position_embeddings": 64,
                    "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, folder)
    prompts = [torch.randint(4, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (90, 40)]
    want, want_lp = [], []
    for prompt in prompts:
        fresh = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        fresh.generation_config.eos_token_id = None
        with torch.inference_mode():
            out = fresh.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        want.append(tokens)
        want_lp.append([torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens,
                                                                                            strict=True)])
    runner = ModelRunner(folder, decide(device="cpu", dtype="float32"), kv_cache_bytes=8 << 20, block_size=4)
    assert runner.max_context == 128
    engine = Engine(runner, scheduler=SchedulerConfig(max_batched_tokens=16))
    for i, prompt in enumerate(prompts):
        engine.add(engine.make_request(str(i), prompt, SamplingParams(max_tokens=30, ignore_eos=True, logprobs=True)))
    got = {rid: [lp for out in outs for lp in out.logprobs] for rid, outs in engine.run_until_idle().items()}
    for i in range(2):
        assert [lp.token_id for lp in got[str(i)]] == want[i]
        # The logprobs too: a theta off by a few percent moves them far more than float32 rounding does.
        assert max(abs(lp.logprob - w) for lp, w in zip(got[str(i)], want_lp[i], strict=True)) < 1e-4


def test_gemma2_greedy_shortcut_caps_what_it_rescores(tmp_path: Path) -> None:
    """The fast CPU modes' greedy shortcut (an int8 head ranks, the top candidates are rescored exactly) under
    Gemma 2's final soft-cap: tanh keeps the ranking, but where it rounds several logits to the cap itself the
    lowest id wins, as in the full capped argmax, not the largest raw logit."""
    kind, extra = CASES["gemma2"]
    build(kind, extra, tmp_path)
    model = ModelRunner(tmp_path, decide(device="cpu", dtype="float32", matmul="packed"), kv_cache_bytes=8 << 20,
                        block_size=4).model
    if model.approx_head is None:
        pytest.skip("no int8 head here (fbgemm)")
    hidden = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 4     # logits far past the cap
    capped = model.logits(hidden)                                                     # (8, V)
    assert ((capped == 3.0).sum(-1) > 1).all()                                        # ties at the cap in every row
    raw = model.lm_head(hidden).float()
    assert not torch.equal(raw.argmax(-1), capped.argmax(-1))                         # so the cap decides
    assert torch.equal(model.greedy(hidden), capped.argmax(-1))
