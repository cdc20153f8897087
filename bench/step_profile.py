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
import platform
import random
import subprocess
import time
from typing import Any

import torch
from transformers import AutoTokenizer

from mesh.models import served_model
from services.engine import plan, sampler
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.model_runner import ModelRunner
from services.engine.request import SamplingParams

PROMPTS = (
    "Write a short note to a neighbour about a parcel left at my door.",
    "Explain how a bicycle gear system works to a ten-year-old.",
    "What should I pack for a three-day hiking trip in autumn?",
    "Summarize the causes of the French Revolution in a paragraph.",
    "Give me a recipe for a quick vegetable soup.",
    "How do I politely decline a meeting invitation?",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the pros and cons of working from home?",
    "Describe the water cycle in simple terms.",
    "Suggest five names for a small coffee shop by the sea.",
    "How does compound interest work? Give an example.",
    "Write a haiku about a city at night.",
    "What is the difference between a virus and a bacterium?",
    "Plan a one-day itinerary for a rainy day in a museum town.",
    "Explain what an API is to someone who does not program.",
    "List some tips for sleeping better.",
)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


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
    timer.wrap(engine, "_postprocess", "postprocess (whole)")
    for i in range(rows):
        text = f"[{tag}-{i}] {PROMPTS[i % len(PROMPTS)]}"
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.7])
    p.add_argument("--steps", type=int, default=32)
    a = p.parse_args()
    name, folder = served_model(a.model)
    config = EngineConfig(model_path=folder, model=name)
    execution = plan.for_config(config)
    runner = ModelRunner(folder, execution, kv_cache_bytes=config.kv_cache_mb << 20, block_size=config.block_size,
                         max_batch=config.max_running)
    engine = Engine(runner)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print(f"{name} on {cpu_name()}, {torch.get_num_threads()} threads; plan: {execution}")
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
