"""LoRA adapters mixed in the engine's steps: 16 streams over 4 adapters and the base model against 16
base-only streams, same prompts and token counts, in the engine itself (no sockets).

    .venv/bin/python bench/lora.py [--model default] [--streams 16] [--tokens 64] [--rank 16]

Builds 4 PEFT adapters of the model (every projection targeted, random factors; needs `peft`), loads them
into an engine running its measured execution plan (as `infermesh up` does), then decodes `--streams`
sampled streams (temperature 0.7, `--tokens` each, a per-run tag in every prompt) twice: all on the base
model, then spread over the 4 adapters and the base.  Prints both tokens/s and their ratio (the target:
within 20%, a ratio of 0.8 or more) with the CPU's name.  Nothing is asserted.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

from bench.engine import QUESTIONS, cpu_name  # noqa: E402 - the served bench's prompts and CPU name
from bench.step_profile import served_engine  # noqa: E402
from services.engine.core.request import SamplingParams  # noqa: E402
from services.engine.engine import Engine  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapters(folder: str, root: Path, count: int, rank: int) -> list[Path]:
    import peft

    # The factors only need the model's shapes and module names: its config, with random weights.
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), torch_dtype=torch.float32)
    out = []
    for i in range(count):
        torch.manual_seed(i)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                                         target_modules=TARGETS))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        model.save_pretrained(str(root / f"a{i}"))
        out.append(root / f"a{i}")
    return out


def run(engine: Engine, tokenizer: object, adapters: list[str], streams: int, tokens: int, tag: str) -> float:
    """Tokens/s of `streams` streams, stream i on adapters[i % len(adapters)] ("": the base model)."""
    for i in range(streams):
        text = f"[{tag}-{i}] {QUESTIONS[i % len(QUESTIONS)]}"
        ids = tokenizer.encode(text)                                               # type: ignore[attr-defined]
        params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=tokens, ignore_eos=True, seed=i)
        engine.add(engine.make_request(f"{tag}-{i}", ids, params, adapter=adapters[i % len(adapters)]))
    started = time.perf_counter()
    outs = engine.run_until_idle()
    seconds = time.perf_counter() - started
    return sum(len(o.new_ids) for chunks in outs.values() for o in chunks) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    name, engine, tokenizer = served_engine(a.model)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        for i, path in enumerate(build_adapters(str(engine.runner.folder), Path(tmp), 4, a.rank)):
            engine.adapters.load(f"a{i}", path)
    print(f"{name} on {cpu_name()}, {torch.get_num_threads()} threads; plan: {engine.runner.plan}; 4 adapters of rank "
          f"{a.rank} ({engine.adapters.nbytes / 1e6:.1f} MB)")
    tag = f"{random.randrange(1 << 30):x}"
    run(engine, tokenizer, [""], 4, 8, tag + "w")                                 # warm up
    base = run(engine, tokenizer, [""], a.streams, a.tokens, tag + "b")
    mixed = run(engine, tokenizer, ["", "a0", "a1", "a2", "a3"], a.streams, a.tokens, tag + "m")
    print(f"{a.streams} streams x {a.tokens} tokens: base only {base:.1f} tok/s; over 4 adapters + base "
          f"{mixed:.1f} tok/s: {mixed / base:.2f} (target >= 0.80)")


if __name__ == "__main__":
    main()
