"""Quality guard: every matmul mode `auto` may choose, against the float32 (transformers-exact) mode.

For 16 prompts, each mode generates 128 greedy tokens in-process (services/engine, no mesh) with
their log-probs.  Reported per mode: how many of the 16 continuations equal float32's token for
token, the first divergence position (median and worst; 128 = none), and the mean absolute
difference of the chosen tokens' log-probs over the positions before any divergence (the same
text, teacher-forced by the shared prefix).  bfloat16 (the model's training dtype, `--dtype
bfloat16`) is the bar: `auto` must never pick a mode that does worse than it on these.

    .venv/bin/python bench/quality.py [--model NAME] [--prompts 16 --tokens 128] [--modes LABEL ...] [--batch N]

`gguf` (the file's own blocks) and `ggufr` (them repacked) run only for a model registered from a GGUF
(`infermesh model register`);
--modes picks modes by label prefix (`--modes bf16 auto gguf`); float32 always runs, as the reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import cpu_name  # noqa: E402
from mesh.models import served_model  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.core.request import SamplingParams  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.engine.runtime.execution_plan import GGUF_MATMULS  # noqa: E402
from services.engine.runtime.model_runner import ModelRunner  # noqa: E402
from services.engine.runtime.models.gguf_weights import has_gguf  # noqa: E402
from services.engine.runtime.plan import decide, for_config  # noqa: E402

TOPICS = ("the history of the printing press", "how a refrigerator works", "the water cycle", "chess openings",
          "the life of honeybees", "volcanoes", "how compilers optimize loops", "the Roman road network",
          "photosynthesis", "the rules of cricket", "black holes", "sourdough baking", "the French Revolution",
          "how vaccines work", "plate tectonics", "the invention of the telephone")
# (label, dtype, matmul, KV cache dtype): float32 exact is the reference; bfloat16 the bar.  The fast
# kinds run as auto runs them, with a float16 KV cache; "q4, float32 KV" isolates what float16 KV costs.
# "auto" is the plan this machine's tuning chose (small and large kinds, split by rows).
MODES = (("float32 (exact)", "float32", "auto", "auto"), ("bfloat16", "bfloat16", "auto", "auto"),
         ("auto (tuned plan)", "auto", "auto", "auto"),
         ("q4", "float32", "q4", "auto"), ("q4, float32 KV", "float32", "q4", "float32"),
         ("fp16w", "float32", "fp16w", "auto"), ("packed", "float32", "packed", "auto"),
         ("bf16w", "float32", "bf16w", "auto"), ("gguf", "float32", "gguf", "auto"),
         ("ggufr (repacked)", "float32", "ggufr", "auto"), ("int8 (--dtype int8)", "int8", "auto", "auto"))


@dataclass
class Quality:
    mode: str
    identical: int
    first_divergence: list[int]
    mean_abs_logprob_diff: float
    seconds: float


def prompts(folder: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Write a detailed essay about {TOPICS[i % 16]}."}],
                                     add_generation_prompt=True, tokenize=False) for i in range(n)]
    return [list(tok.encode(str(text), add_special_tokens=False)) for text in texts]


def generate(folder: Path, dtype: str, matmul: str, ids: list[list[int]], tokens: int, kv_dtype: str = "auto",
             batch: int = 0) -> tuple[list[list[int]], list[list[float]], float]:
    """Greedy continuations of `ids` with their log-probs: all at once, or `batch` prompts at a time (so the
    kernels of 1-4 row steps are the ones measured)."""
    if dtype == "auto":
        plan = for_config(EngineConfig(model_path=str(folder)))      # tuned here (cached), as an engine runs
    else:
        plan = decide(device="cpu", dtype=dtype, matmul=matmul, kv_dtype=kv_dtype)
    engine = Engine(ModelRunner(folder, plan, kv_cache_bytes=256 << 20))
    started = time.perf_counter()
    out: dict[str, list[tuple[int, float]]] = {str(i): [] for i in range(len(ids))}
    size = batch or len(ids)
    for first in range(0, len(ids), size):
        for i in range(first, min(first + size, len(ids))):
            engine.add(engine.make_request(str(i), ids[i], SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                                          logprobs=True)))
        for rid, outs in engine.run_until_idle().items():
            out[rid] += [(lp.token_id, lp.logprob) for step in outs for lp in step.logprobs]
    seconds = time.perf_counter() - started
    return ([[t for t, _ in out[str(i)]] for i in range(len(ids))],
            [[lp for _, lp in out[str(i)]] for i in range(len(ids))], seconds)


def compare(label: str, ref: tuple[list[list[int]], list[list[float]], float],
            got: tuple[list[list[int]], list[list[float]], float]) -> Quality:
    firsts, diffs = [], []
    for rt, rl, gt, gl in zip(ref[0], ref[1], got[0], got[1], strict=True):
        first = next((i for i, (a, b) in enumerate(zip(rt, gt, strict=True)) if a != b), len(rt))
        firsts.append(first)
        diffs += [abs(a - b) for a, b in zip(rl[:first], gl[:first], strict=True)]
    return Quality(label, sum(f == len(ref[0][0]) for f in firsts), firsts,
                   statistics.fmean(diffs) if diffs else float("nan"), got[2])


def run(folder: Path, n: int = 16, tokens: int = 128, only: tuple[str, ...] = (), batch: int = 0) -> list[Quality]:
    ids = prompts(folder, n)
    ref = generate(folder, "float32", "auto", ids, tokens, batch=batch)
    results = []
    for label, dtype, matmul, kv_dtype in MODES:
        if only and not label.startswith(("float32", *only)) or matmul in GGUF_MATMULS and not has_gguf(folder):
            continue
        got = ref if label.startswith("float32") else generate(folder, dtype, matmul, ids, tokens, kv_dtype, batch)
        results.append(compare(label, ref, got))
    return results


def report(results: list[Quality], tokens: int) -> list[str]:
    lines = [f"{'mode':<22} {'identical':>9} {'first divergence median/worst':>30} {'mean |dlogprob|':>16} "
             f"{'gen s':>6}"]
    for q in results:
        lines.append(f"{q.mode:<22} {q.identical:>6}/{len(q.first_divergence):<2} "
                     f"{statistics.median(q.first_divergence):>20.0f} / {min(q.first_divergence):<7} "
                     f"{q.mean_abs_logprob_diff:>16.5f} {q.seconds:>6.1f}")
    lines.append(f"({tokens} greedy tokens per prompt; divergence {tokens} = none; log-prob differences over the "
                 "tokens before the first divergence)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--model", default="default", help="a served model's NAME (`infermesh model list`)")
    parser.add_argument("--modes", nargs="*", default=[], help="only the modes whose labels start so")
    parser.add_argument("--batch", type=int, default=0,
                        help="prompts run together (default all): 1-4 measures the small-batch kernels")
    args = parser.parse_args()
    name, folder = served_model(args.model)
    print(f"{name} on {cpu_name()}, {args.batch or args.prompts} prompts at a time")
    print("\n".join(report(run(Path(folder), args.prompts, args.tokens, tuple(args.modes), args.batch),
                            args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
