"""Which GEMM kind is fastest on this CPU for this model, at each batch size: measured, not assumed.

The machines an engine lands on differ (an AVX2-only EPYC multiplies bf16 slowly; a Xeon with AMX
fast; a q4 kernel wins wherever decode is memory-bound), so the execution plan's CPU matmul kinds
come from timing the candidates here: each multiplies activations of 1, 4, 16 and 64 rows by
weights of the model's own shapes (8 layers' worth, so they stream from memory as in a real step),
and the fastest at 1 row serves small batches, the fastest at 64 rows large ones (if it is worth a
second copy of the weights: 1.5x faster there), split where the small one stops winning.  The
answer is cached per CPU, torch version, kernel source and model shape under $INFERMESH_HOME/plans/,
so only the first start on a machine pays the few seconds.  An answer measured while other processes kept
the CPU busy (more than BUSY cores of theirs, from /proc/stat) can be wrong by 10x for one kind: it is
cached as provisional, and the next start that finds the machine quiet measures again.
`infermesh tune [MODEL]` measures ahead of time (and prints the table).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mesh.files import exclusive_lock, write_atomic
from mesh.heap import trim_heap
from mesh.models import home
from meshkernels import cpu_ops
from services.engine.runtime.execution_plan import GGUF_MATMULS
from services.engine.runtime.models.config import load_weights
from services.engine.runtime.models.gguf_weights import FILE, has_gguf
from services.engine.runtime.models.linear import LINEARS, Concat, native_bf16

log = logging.getLogger(__name__)

ROWS = (1, 4, 16, 64)
LAYERS = 8              # distinct weights timed: enough that they stream from memory, not cache
SECOND_COPY = 1.5       # how much faster a second kind's 64-row step must be to be worth its copy
ONE_COPY = 1.1          # ... and the small kind's 1-row step than the large kind's: else the large kind serves all
VERSION = 5             # bump when the candidates or the method change: old answers are then ignored
BUSY = 0.25             # other processes' CPU (cores, averaged) above which a measurement is provisional


@dataclass(frozen=True)
class Tuned:
    small: str                      # the kind for up to `rows` rows
    large: str                      # above them ("" or equal to small: one kind)
    rows: int
    ms: dict[str, list[float]]      # kind -> ms per model step (all layers' GEMMs) at ROWS
    busy: float = 0.0               # cores other processes used while it was measured (> BUSY: provisional)


def candidates(folder: Path | None = None) -> list[str]:
    """The CPU kinds this build can run (models/linear.py names), the exact one aside; `gguf` for a folder
    whose weights are a GGUF file."""
    kinds = []
    if cpu_ops.load():
        kinds.append("q4")
        if folder is not None and has_gguf(folder):
            kinds += ["gguf", "ggufr"]
    if "fbgemm" in torch.backends.quantized.supported_engines:
        kinds.append("fp16w")
    if torch.backends.mkldnn.is_available():
        kinds.append("packed")
        if native_bf16():             # bf16 only where the CPU multiplies it natively (the quality bar)
            kinds.append("bf16w")
    return kinds


def shapes(folder: Path) -> tuple[int, list[tuple[int, int]]]:
    """(layers, the (out, in) of one layer's four GEMMs: q/k/v, o, gate/up, down)."""
    c = json.loads((folder / "config.json").read_text())
    h, heads = c["hidden_size"], c["num_attention_heads"]
    d = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads)
    inter = c["intermediate_size"]
    return c["num_hidden_layers"], [((heads + 2 * kv) * d, h), (h, heads * d), (2 * inter, h), (h, inter)]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_file(layers: int, gemms: list[tuple[int, int]], kinds: list[str]) -> Path:
    # The ops' build (INFERMESH_CPU_ISA=avx512 leaves AMX out): an AMX plan is not the AVX-512 build's.
    key = hashlib.sha256(json.dumps([VERSION, _cpu_name(), sorted(_flags()), cpu_ops.build_flags(), torch.__version__,
                                     torch.get_num_threads(), layers, gemms, kinds,
                                     cpu_ops.source_digests()]
                                    ).encode()).hexdigest()[:16]
    return home() / "plans" / f"{key}.json"


def _flags() -> set[str]:
    return {f for f in cpu_ops._cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))}


def measure(layers: int, gemms: list[tuple[int, int]], kinds: list[str], reps: int = 3,
            folder: Path | None = None) -> dict[str, list[float]]:
    """ms per model step of each kind at ROWS, from LAYERS layers of random weights scaled up (`gguf`: the
    first LAYERS layers of `folder`'s own GGUF blocks)."""

    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in gemms] for _ in range(min(layers, LAYERS))]
    table: dict[str, list[float]] = {}
    for kind in kinds:
        if kind == "q4" and any(k % 32 for _, k in gemms):
            continue                                  # no 32-weight blocks along these inputs
        try:
            if kind in GGUF_MATMULS and folder is not None:
                calls = _gguf_calls(folder, len(weights), LINEARS[kind])
            else:
                calls = [(_multiply(kind, w), w.shape[1]) for layer in weights for w in layer]
            table[kind] = [_time(calls, rows, reps) * layers / len(weights) for rows in ROWS]
        except (RuntimeError, ValueError) as exc:      # a kind this build or shape cannot run: not a candidate
            log.warning("matmul kind %s left out of tuning: %s", kind, exc)
    return table


def _multiply(kind: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x W^T by `kind`.  q4 times its kernel on the blocks even where packing is lossy (random
    weights are), which the model's Q4Linear would not use."""
    if kind != "q4":
        return LINEARS[kind](weight, None)
    from meshkernels import quant

    packed = quant.pack_q4(weight)
    return lambda x: torch.ops.infermesh.q4_linear(x, packed.data, packed.out_features)


GGUF_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
               ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _gguf_calls(folder: Path, count: int, kind: Callable[..., Any]) -> list[tuple[Callable[[torch.Tensor],
                                                                                           torch.Tensor], int]]:
    """The `gguf` (or `ggufr`) kind's products over the first `count` layers of the folder's GGUF, as the model
    groups them."""
    weights = load_weights(folder)
    calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]] = []
    for i in range(count):
        for group in GGUF_GROUPS:
            parts = [weights[f"model.layers.{i}.{name}.weight"] for name in group]
            calls.append((Concat(kind, parts, [None] * len(parts)), parts[0].shape[1]))
    return calls


def file_key(folder: Path) -> str:
    """The GGUF file's size and modification time: part of tuning's (and outliers.py's) cache key (another
    file, another answer) without parsing the file (its header's tokenizer arrays take seconds to read)."""
    stat = (folder / FILE).stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


def _time(calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]], rows: int, reps: int) -> float:
    xs = {k: torch.randn(rows, k) for _, k in calls}
    best = float("inf")
    for rep in range(reps + 1):                       # the first warms packing caches and the thread pool
        started = time.perf_counter()
        for multiply, k in calls:
            multiply(xs[k])
        if rep:
            best = min(best, time.perf_counter() - started)
    return best * 1e3


def choose(table: dict[str, list[float]]) -> Tuned:
    """The fastest kind at 1 row for small batches, at 64 rows for large ones; the split is the
    largest measured row count where the small kind is still at least as fast as the large one.
    A second kind is a second copy of every weight in memory: it is taken only where it pays for it,
    a 64-row step at least SECOND_COPY times faster than the small kind's, and the small kind's 1-row step
    at least ONE_COPY times faster than the large kind's (else the large kind alone: a Qwen 1.5B's file blocks
    were 7% faster at one row than its repacked blocks, 4x slower at 64)."""
    small = min(table, key=lambda k: table[k][0])
    large = min(table, key=lambda k: table[k][-1])
    if table[small][-1] < SECOND_COPY * table[large][-1]:
        large = small
    elif table[large][0] < ONE_COPY * table[small][0]:
        small = large
    rows = max((r for i, r in enumerate(ROWS) if table[small][i] <= table[large][i]), default=0)
    if large == small or rows >= ROWS[-1]:
        return Tuned(small, "", 0, table)
    return Tuned(small, large, rows, table)


def tune(folder: Path, use_cache: bool = True) -> Tuned | None:
    """The measured choice for the model at `folder` on this CPU (cached), or None without candidates."""
    kinds = candidates(folder)
    if not kinds:
        return None
    try:
        layers, gemms = shapes(folder)
    except (OSError, KeyError, ValueError) as exc:
        log.warning("cannot read the model's shapes to tune for (%s): the unmeasured default plan", exc)
        return None
    cache = _cache_file(layers, gemms, _keyed(kinds, folder))
    # Engines starting together (`infermesh up --engines N`) measure one at a time: the first writes
    # the answer and the others read it, instead of all timing each other's contention.
    with exclusive_lock(cache.with_suffix(".lock")):
        if use_cache and cache.exists():
            cached_answer = _read(cache)
            if cached_answer is not None and not (cached_answer.busy > BUSY and _others(0.2) <= BUSY):
                return cached_answer
            if cached_answer is None:
                log.warning("ignoring an unreadable tuning cache %s", cache)
        started = time.monotonic()
        others = _others_since()
        table = measure(layers, gemms, kinds, folder=folder)
        # The trial kinds' weights, freed, back to the system: glibc kept them (the 0.5B's engine held 1170 MB
        # after a first start's tuning against 830 after a cached one; 713 -> 254 MB with the trim).
        trim_heap()
        if not table:
            return None
        tuned = replace(choose(table), busy=round(others(), 2))
        log.info("tuned the CPU matmuls in %.1f s: %s", time.monotonic() - started, describe(tuned))
        if tuned.busy > BUSY:
            log.warning("other processes kept %.1f cores busy while the matmuls were timed: the answer is "
                        "provisional, measured again at the next start on a quiet machine (or run `infermesh "
                        "tune --again` then)", tuned.busy)
        write_atomic(cache, json.dumps(asdict(tuned), indent=1).encode())
        return tuned


def cached(folder: Path) -> Tuned | None:
    """The answer tune() would return from its cache for the model at `folder` on this CPU, or None when it
    has not been measured here yet (nothing is timed)."""
    kinds = candidates(folder)
    try:
        layers, gemms = shapes(folder)
    except (OSError, KeyError, ValueError):
        return None
    return _read(_cache_file(layers, gemms, _keyed(kinds, folder))) if kinds else None


def _keyed(kinds: list[str], folder: Path) -> list[str]:
    """The kinds as the cache key names them: `gguf` with the file's layer types."""
    return [f"{kind}[{file_key(folder)}]" if kind in GGUF_MATMULS else kind for kind in kinds]


def _others_since() -> Callable[[], float]:
    """A probe started now: calling it gives the cores other processes kept busy since, on average (every
    CPU's non-idle time in /proc/stat, steal included, less this process's own); 0.0 without /proc/stat."""
    def busy_seconds() -> float | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)               # idle + iowait
        guests = sum(fields[8:10])                                              # already counted in user
        return (sum(fields) - idle - guests) / os.sysconf("SC_CLK_TCK")

    first, own, started = busy_seconds(), time.process_time(), time.monotonic()

    def since() -> float:
        last = busy_seconds()
        elapsed = time.monotonic() - started
        if first is None or last is None or elapsed <= 0:
            return 0.0
        return max(0.0, (last - first - (time.process_time() - own)) / elapsed)
    return since


def _others(seconds: float) -> float:
    """The cores other processes use now: _others_since over `seconds` of sleep."""
    probe = _others_since()
    time.sleep(seconds)
    return probe()


def _read(cache: Path) -> Tuned | None:
    """A cached answer, or None when the file is missing or unreadable."""
    try:
        return Tuned(**json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def describe(tuned: Tuned) -> str:
    head = f"{tuned.small}" + (f" up to {tuned.rows} rows, {tuned.large} above" if tuned.large else " at every size")
    cells = "; ".join(f"{k} " + "/".join(f"{ms:.1f}" for ms in v) for k, v in tuned.ms.items())
    busy = f"; provisional: measured while other processes used {tuned.busy:.1f} cores" if tuned.busy > BUSY else ""
    return f"{head} (ms per step at {'/'.join(map(str, ROWS))} rows: {cells}{busy})"
