"""gguf_linear (meshkernels/cpu_gguf.cpp: GGUF blocks as the file stores them, int8 activations) against
the engine's fp16w (FBGEMM fp16 weights) and bf16w (oneDNN bf16 weights, AMX where the CPU has it) on
Qwen2.5-0.5B's or SmolLM2-135M's shapes, with the weights streamed from memory as in a decode step.

    .venv/bin/python bench/gguf_kernels.py [--model qwen2.5-0.5b|qwen2.5-1.5b|smollm2-135m] [--rows 1 4 16 64]
        [--kinds Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K] [--shapes qkv o gate_up down lm_head]

Each method gets its own copies of the weight (as many as fill --stream-mb, at least 2), and the
timed calls cycle through them, so no weight sits in a cache between its uses.  For each (K, N) the
kinds a GGUF can hold there are run (K-quants need K a multiple of 256; the LM head is Q8_0).  Prints
the CPU's name, milliseconds per call and the ratios fp16w / gguf and bf16w / gguf (above 1: gguf is
faster).  Nothing is asserted: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")   # as the engine runs: large tensors in 2 MB pages

import torch  # noqa: E402 - after the allocator's setting

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

from meshkernels import cpu_ops, gguf_blocks  # noqa: E402
from services.engine.runtime.models.linear import Bf16WeightLinear, Fp16WeightLinear  # noqa: E402

# (K, N) of q/k/v fused, o, gate/up fused, down, and the LM head (a tied embedding: Q8_0 in Qwen2.5's Q4_K_M
# files and in SmolLM2's Q4_1 file, whose other linear weights are all Q4_1; K = 576 holds no K-quant).
MODELS = {
    "qwen2.5-0.5b": {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896),
                     "lm_head": (896, 151936)},
    "smollm2-135m": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                     "lm_head": (576, 49152)},
    "qwen2.5-1.5b": {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536),
                     "lm_head": (1536, 151936)},   # Q4_K_M: q/k/o/gate/up Q4_K, v/down/head Q6_K
}
SHAPES = list(MODELS["qwen2.5-0.5b"])          # the same names for every model


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def random_blocks(n: int, k: int, kind: int, rng: np.random.Generator) -> torch.Tensor:
    """Valid blocks: random bytes, with every fp16 scale a small finite value."""
    info = gguf_blocks.KINDS[kind]
    raw = rng.integers(0, 256, (n, k // info.weights, info.bytes), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-2, (n, k // info.weights)).astype(np.float16)[..., None].view(np.uint8)
    mins = info.weights == 256 or kind == gguf_blocks.Q4_1     # fp16 d and a second fp16 (dmin, m)
    for at in ([208] if kind == gguf_blocks.Q6_K else [0, 2] if mins else [0]):
        raw[:, :, at:at + 2] = scales
    return torch.from_numpy(raw.reshape(n, -1))


def time_calls(calls: list[Callable[[], object]], min_seconds: float = 0.3, min_passes: int = 5) -> float:
    """Milliseconds per call: the median over passes through `calls` (one per weight copy), after a
    warm-up pass (the median, not the mean: another process's burst should not count)."""
    for call in calls:
        call()
    passes: list[float] = []
    started = time.perf_counter()
    while len(passes) < min_passes or time.perf_counter() - started < min_seconds:
        begun = time.perf_counter()
        for call in calls:
            call()
        passes.append((time.perf_counter() - begun) / len(calls) * 1e3)
    return statistics.median(passes)


def copies_for(nbytes: int, stream_mb: float) -> int:
    return max(2, min(512, math.ceil(stream_mb * 2**20 / nbytes)))


def bench_gguf(k: int, n: int, kind: int, rows: list[int], stream_mb: float) -> dict[int, float]:
    base = random_blocks(n, k, kind, np.random.default_rng(kind))
    weights = [base.clone() for _ in range(copies_for(base.numel(), stream_mb))]
    out: dict[int, float] = {}
    for t in rows:
        x, y = torch.randn(t, k), torch.empty(t, n)
        out[t] = time_calls([functools.partial(torch.ops.infermesh.gguf_linear, x, w, kind, y) for w in weights])
    return out


def bench_dense(k: int, n: int, make: Callable[[torch.Tensor, None], Callable[[torch.Tensor], torch.Tensor]],
                rows: list[int], stream_mb: float) -> dict[int, float]:
    w = torch.randn(n, k) * 0.02
    layers = [make(w, None) for _ in range(copies_for(2 * n * k, stream_mb))]
    del w
    out: dict[int, float] = {}
    for t in rows:
        x = torch.randn(t, k)
        out[t] = time_calls([functools.partial(layer, x) for layer in layers])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=list(MODELS))
    parser.add_argument("--kinds", nargs="+", default=["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"],
                        choices=[v.qtype.name for v in gguf_blocks.KINDS.values()])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, choices=SHAPES)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    parser.add_argument("--stream-mb", type=float, default=1024.0,
                        help="bytes of weight copies per method and shape (more than the last-level cache)")
    parser.add_argument("--gguf-only", action="store_true", help="skip fp16w and bf16w (their columns read nan)")
    args = parser.parse_args()
    if not cpu_ops.load():
        print("the CPU library is not available (see meshkernels.cpu_ops' warning)", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = [int(getattr(gguf_blocks, name)) for name in args.kinds]
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"weights streamed ({args.stream_mb:.0f} MB of copies per method)")
    print(f"{'shape':>8} {'K':>5} {'N':>6} {'kind':>5} {'rows':>4} {'gguf ms':>8} {'fp16w ms':>9} {'bf16w ms':>9} "
          f"{'fp16w/gguf':>10} {'bf16w/gguf':>10} {'gguf GB/s':>9}")
    for name in args.shapes:
        k, n = MODELS[args.model][name]
        here = [kind for kind in kinds if k % gguf_blocks.KINDS[kind].weights == 0
                and (name != "lm_head" or kind == gguf_blocks.Q8_0)]
        if not here:
            continue
        skipped = dict.fromkeys(args.rows, math.nan)
        fp16 = skipped if args.gguf_only else bench_dense(k, n, Fp16WeightLinear, args.rows, args.stream_mb)
        bf16 = skipped if args.gguf_only else bench_dense(k, n, Bf16WeightLinear, args.rows, args.stream_mb)
        for kind in here:
            gguf = bench_gguf(k, n, kind, args.rows, args.stream_mb)
            nbytes = n * k // gguf_blocks.KINDS[kind].weights * gguf_blocks.KINDS[kind].bytes
            for t in args.rows:
                print(f"{name:>8} {k:>5} {n:>6} {gguf_blocks.KINDS[kind].qtype.name:>5} {t:>4} {gguf[t]:>8.3f} "
                      f"{fp16[t]:>9.3f} {bf16[t]:>9.3f} {fp16[t] / gguf[t]:>10.2f} {bf16[t] / gguf[t]:>10.2f} "
                      f"{nbytes / gguf[t] / 1e6:>9.1f}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
