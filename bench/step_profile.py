"""Where one served decode step's milliseconds go, in the engine itself (no sockets): N rows of varied
everyday chats decoding together, greedy or sampled, with the step split into the model's layers, its
LM head, sampling (and logprobs), and the rest (scheduling, bookkeeping).

    .venv/bin/python bench/step_profile.py --model qwen05 --rows 1 16 --temperature 0.7

The engine runs its measured execution plan (as `infermesh up` does); every prompt carries a per-run
tag.  Nothing is asserted: the figures are printed, with the CPU's name.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")   # as the engine runs: large tensors in 2 MB pages

import torch  # noqa: E402 - after the allocator's setting
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

from bench.engine import QUESTIONS, cpu_name  # noqa: E402 - the served bench's prompts and CPU name
from mesh.models import served_model  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.core.request import SamplingParams  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.engine.runtime import (
    plan,
    sampler,  # noqa: E402
)
from services.engine.runtime.model_runner import ModelRunner  # noqa: E402


class Timer:
    """Wraps callables, summing their wall time per label."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = collections.defaultdict(float)

    def wrap(self, obj: Any, attr: str, label: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[label] += time.perf_counter() - started
        setattr(obj, attr, timed)


def profile(engine: Engine, tokenizer: Any, rows: int, temperature: float, steps: int, tag: str) -> dict[str, float]:
    timer = Timer()
    timer.wrap(engine, "_run", "model (whole)")
    timer.wrap(engine.runner.model, "lm_head", "LM head")
    timer.wrap(sampler, "sample_batch", "sampling")
    timer.wrap(engine, "_update", "update (whole)")
    for i in range(rows):
        text = f"[{tag}-{i}] {QUESTIONS[i % len(QUESTIONS)]}"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, seed=i,
                                max_tokens=steps + 8, ignore_eos=True)
        engine.add(engine.make_request(f"{tag}-{i}", list(ids), params))
    while engine._inbox or any(r.num_generated == 0 for r in engine._requests.values()):
        engine.step()                                   # prefill (and the first tokens): not measured
    timer.spent.clear()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - started) / steps
    out = {k: v / steps for k, v in timer.spent.items()}
    out["step"] = wall
    while engine.has_work():
        engine.step()
    return out


def served_engine(model: str) -> tuple[str, Engine, Any]:
    """(name, an engine on the plan `infermesh up` would measure and run here, its tokenizer) of a served model."""
    name, folder = served_model(model)
    config = EngineConfig(model_path=folder, model=name)
    runner = ModelRunner(folder, plan.for_config(config), kv_cache_bytes=config.kv_cache_mb << 20,
                         block_size=config.block_size, max_batch=config.max_running)
    return name, Engine(runner), AutoTokenizer.from_pretrained(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.7])
    p.add_argument("--steps", type=int, default=32)
    a = p.parse_args()
    name, engine, tokenizer = served_engine(a.model)
    print(f"{name} on {cpu_name()}, {torch.get_num_threads()} threads; plan: {engine.runner.plan}")
    tag = f"{random.randrange(1 << 30):x}"
    print("| rows | temperature | step ms | tok/s | layers ms | LM head ms | sampling ms | rest ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for temperature in a.temperature:
        for rows in a.rows:
            t = profile(engine, tokenizer, rows, temperature, a.steps, tag)
            model, head, sample = t.get("model (whole)", 0.0), t.get("LM head", 0.0), t.get("sampling", 0.0)
            rest = t["step"] - model - sample          # scheduling, logprobs, bookkeeping
            print(f"| {rows} | {temperature:g} | {t['step'] * 1e3:.1f} | {rows / t['step']:.1f} | "
                  f"{(model - head) * 1e3:.1f} | {head * 1e3:.1f} | {sample * 1e3:.1f} | {rest * 1e3:.1f} |")


if __name__ == "__main__":
    main()
