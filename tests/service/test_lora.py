"""LoRA adapters in the engine (issue 36; services/engine/runtime/lora.py, adapters.py): a PEFT adapter built on
the default
model (nonzero B matrices, every projection targeted), loaded at run time, answers greedily as transformers +
peft does; one step holding base-model rows and two adapters' rows gives every row its own model's tokens; bad
adapters are refused by name; an unloaded adapter is NOT_FOUND for later requests; over the engine's gRPC
(LoadAdapter, Generate's adapter, UnloadAdapter) with its metrics."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mesh.errors import InvalidArgument, NotFound
from services.engine.core.request import SamplingParams
from services.engine.engine import Engine
from services.engine.runtime.adapters import shape_of
from services.engine.runtime.lora import load_adapter
from services.engine.runtime.lora_gguf import load_gguf_adapter
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide
from tests.lora_adapters import TARGETS, build_adapter, write_gguf_lora

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
TOKENS = 12


@pytest.fixture(scope="module")
def adapters(hf, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:  # type: ignore[no-untyped-def]
    base, _ = hf
    root = tmp_path_factory.mktemp("lora")
    return {"alpha": (root / "alpha", build_adapter(base, root / "alpha", 1, 8, TARGETS)),
            "beta": (root / "beta", build_adapter(base, root / "beta", 2, 4, ["q_proj", "v_proj", "down_proj"]))}


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, decide(device="cpu", dtype="float32"), kv_cache_bytes=64 << 20)


def greedy(model: Any, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.slow                    # over 5 s of model runs on 2 cores: make test runs it, make test-fast not
def test_an_adapter_answers_as_transformers_and_peft_and_mixes_with_others_in_a_step(  # type: ignore[no-untyped-def]
        runner: ModelRunner, hf, adapters) -> None:
    base, tokenizer = hf
    engine = Engine(runner)
    for name, (folder, _) in adapters.items():
        engine.adapters.load(name, folder)
    asked = [(p, name) for p in PROMPTS for name in ("", "alpha", "beta")]
    for i, (prompt, name) in enumerate(asked):          # nine requests in the same steps
        engine.add(engine.make_request(f"r{i}", tokenizer.encode(prompt), SamplingParams(max_tokens=TOKENS),
                                       adapter=name))
    outs = engine.run_until_idle()
    for i, (prompt, name) in enumerate(asked):
        got = [t for o in outs[f"r{i}"] for t in o.new_ids]
        reference = adapters[name][1] if name else base
        assert got == greedy(reference, tokenizer.encode(prompt)), (prompt, name)
    assert greedy(adapters["alpha"][1], tokenizer.encode(PROMPTS[0])) != greedy(base, tokenizer.encode(PROMPTS[0]))


def test_a_gguf_lora_file_as_llama_cpp_writes_it_is_the_same_adapter(  # type: ignore[no-untyped-def]
        runner: ModelRunner, hf, adapters, model_dir: Path, tmp_path: Path) -> None:
    """alpha's PEFT folder written as llama.cpp's converter writes a GGUF LoRA (q/k rows permuted, F32 and F16):
    read back, the same factors (F16: to its rounding), and the same greedy answers as transformers + peft."""
    _, tokenizer = hf
    config = runner.config
    folder = adapters["alpha"][0]
    peft_factors = load_adapter("alpha", folder, shape_of(runner)).layers
    for half in (False, True):
        file = write_gguf_lora(folder, tmp_path / f"alpha-{int(half)}.gguf", config.num_heads, config.num_kv_heads,
                               half)
        read = load_gguf_adapter("alpha", file, shape_of(runner)).layers
        for layer, layer_gguf in zip(peft_factors, read, strict=True):
            assert layer.keys() == layer_gguf.keys()
            for p, f in layer.items():
                tol = {"rtol": 2e-3, "atol": 1e-4} if half else {"rtol": 0, "atol": 0}
                torch.testing.assert_close(layer_gguf[p].a, f.a, **tol)
                torch.testing.assert_close(layer_gguf[p].b, f.b, **tol)
    engine = Engine(runner)
    engine.adapters.load("alpha-gguf", tmp_path / "alpha-0.gguf")
    ids = tokenizer.encode(PROMPTS[1])
    engine.add(engine.make_request("g", ids, SamplingParams(max_tokens=TOKENS), adapter="alpha-gguf"))
    got = [t for o in engine.run_until_idle()["g"] for t in o.new_ids]
    assert got == greedy(adapters["alpha"][1], ids)
    with pytest.raises(InvalidArgument, match="not a LoRA adapter"):      # the base model's own GGUF
        engine.adapters.load("base", model_dir / "model.gguf")


def test_bad_adapters_are_refused_by_name_and_an_unloaded_one_is_not_found(  # type: ignore[no-untyped-def]
        runner: ModelRunner, hf, adapters, tmp_path: Path) -> None:
    _, tokenizer = hf
    engine = Engine(runner)
    with pytest.raises(InvalidArgument, match="is not a folder"):
        engine.adapters.load("x", tmp_path / "missing")
    other = tmp_path / "other-base"
    other.mkdir()
    folder = adapters["beta"][0]
    (other / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in tensors.items()},
              str(other / "adapter_model.safetensors"))
    wide = r"lora_A\.weight' has shape \(4, 3072\); the model's layer 0 down_proj \(1536 -> 576\) at rank 4 expects "
    with pytest.raises(InvalidArgument, match=wide + r"\(4, 1536\): an adapter of another base"):
        engine.adapters.load("wide", other)
    config = json.loads((folder / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(InvalidArgument, match="DoRA"):
        engine.adapters.load("dora", other)
    # Its prefix-cache namespace follows the weights: read again from them (after an eviction) it is the same,
    # the name loaded from other weights is another.
    assert engine.adapters.load("beta", folder).key == engine.adapters.load("beta", folder).key
    assert engine.adapters.load("beta", adapters["alpha"][0]).key != engine.adapters.load("beta", folder).key
    ids = tokenizer.encode(PROMPTS[0])
    engine.add(engine.make_request("ok", ids, SamplingParams(max_tokens=2), adapter="beta"))
    assert engine.adapters.unload("beta") and not engine.adapters.unload("beta")
    with pytest.raises(NotFound, match="'beta' is not loaded"):
        engine.make_request("late", ids, SamplingParams(max_tokens=2), adapter="beta")
    outs = engine.run_until_idle()                      # the request that began with it still ends on it
    assert sum(len(o.new_ids) for o in outs["ok"]) == 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """A tiny random Llama, a PEFT adapter of it, and the adapted model (transformers + peft)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tiny-lora")
    base = LlamaForCausalLM(config).eval()
    base.save_pretrained(root / "base")
    adapted = build_adapter(base, root / "adapter", 3, 4, TARGETS)
    return root / "base", root / "adapter", adapted


def test_adapters_over_grpc(tiny: tuple[Path, Path, Any]) -> None:  # type: ignore[no-untyped-def]
    import grpc
    from prometheus_client import REGISTRY

    from meshpb.v1 import common_pb2, engine_pb2
    from tests.service.test_engine_server import serving

    base, folder, adapted = tiny
    prompt = [5, 6, 7, 8]

    def generate(adapter: str) -> engine_pb2.GenerateRequest:
        return engine_pb2.GenerateRequest(request_id=f"r-{adapter}", prompt_ids=prompt, adapter=adapter,
                                          sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True))

    async def scenario() -> None:
        async with serving(base) as (stub, servicer):
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.LoadAdapter(engine_pb2.LoadAdapterRequest(name="a", path=str(folder.parent / "none")))
            assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            loaded = await stub.LoadAdapter(engine_pb2.LoadAdapterRequest(name="a", path=str(folder)))
            assert list(loaded.adapters) == ["a"] and loaded.load_seconds > 0
            assert list((await stub.GetInfo(engine_pb2.EngineInfoRequest())).adapters) == ["a"]
            got = [t for reply in await _read(stub.Generate(generate("a"))) for t in reply.ids]
            with torch.inference_mode():
                want = adapted.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                        pad_token_id=0)[0, len(prompt):].tolist()
            assert got == want
            labels = {"replica": "engine-t"}
            assert REGISTRY.get_sample_value("infermesh_engine_lora_requests_total", {**labels, "adapter": "a"}) == 1
            assert REGISTRY.get_sample_value("infermesh_engine_lora_adapters", labels) == 1
            assert REGISTRY.get_sample_value("infermesh_engine_lora_load_seconds_count", labels) == 1
            gone = await stub.UnloadAdapter(engine_pb2.UnloadAdapterRequest(name="a"))
            assert gone.found and not gone.adapters
            assert REGISTRY.get_sample_value("infermesh_engine_lora_adapters", labels) == 0
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await _read(stub.Generate(generate("a")))
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "'a' is not loaded" in (
                unknown.value.details() or "")

    asyncio.run(scenario())


async def _read(call: Any) -> list[Any]:
    return [reply async for reply in call]
