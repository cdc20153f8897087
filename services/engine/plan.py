"""The ExecutionPlan: which device, dtype, matmul kind, kernels and graph mode an engine runs.

The config says what was asked for (mostly `auto`); decide() turns that into one frozen plan for
this machine, once, at start.  The model runner and the model only follow it; the engine logs it,
GetInfo reports it and /metrics exports it (infermesh_engine_plan_info).  Nothing else chooses a
fast path.

What `auto` means today:
- CPU: float32; the matmul kinds measured fastest on this machine for the model's shapes
  (services/engine/tune.py, cached): typically `q4` (the model's own 4-bit blocks) for small
  batches and `fp16w` or `packed` above `split_rows` rows; for a GGUF folder (`infermesh model register`)
  `gguf`, the file's own blocks, is a candidate too, timed on the file's own layers; without a model to
  measure, `fp16w` with FBGEMM (`packed` with oneDNN only, else `exact`).  Decode attention and the norm/RoPE/SiLU ops
  are the fused CPU library (meshkernels/cpu_ops.cpp) when it builds, else torch's; with the fused
  library (not `exact`) the KV cache holds float16 (half the bytes decode attention streams,
  twice the tokens per GB).  No graphs.
  An explicit --dtype float32 is the bit-exact mode: `exact` matmuls and the torch ops
  (transformers' own math); --dtype int8 quantizes the weights.
- CUDA: bfloat16, `fused` GEMMs (q/k/v and gate/up one call each), Triton decode attention and
  Triton norm/RoPE/SiLU ops, pure-decode steps replayed from CUDA graphs.  --dtype float32 keeps
  `exact` GEMMs and the torch ops, with Triton decode attention.

The names each field takes are the keys of the registries that carry them out:
models/linear.py (matmul), models/attention.py (attention), models/ops.py (ops),
decode_graphs.py (graphs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from meshkernels import cpu_ops
from services.engine import tune
from services.engine.config import GRAPHS, EngineConfig

MATMULS = ("exact", "fused", "packed", "fp16w", "int8", "q4", "bf16w", "gguf")
ATTENTIONS = ("torch", "fused", "triton")   # decode attention: gather + SDPA, the CPU library, Triton
OPS = ("torch", "cpu", "triton")            # add + RMSNorm, RoPE + KV write, SiLU x up
KV_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ExecutionPlan:
    device: str          # cpu | cuda
    dtype: str           # float32 | bfloat16: activations; the KV cache too unless kv_dtype (int8 weights: float32)
    matmul: str          # MATMULS
    attention: str       # ATTENTIONS
    ops: str             # OPS
    graphs: str          # config.GRAPHS; "eager": the graphs' padded buffers without capture (tests)
    matmul_large: str = ""   # MATMULS: the kind above split_rows rows; "": `matmul` at every size
    split_rows: int = 0
    kv_dtype: str = ""       # KV_DTYPES: what the KV cache holds; "": `dtype`

    def __post_init__(self) -> None:
        for name, allowed in (("device", ("cpu", "cuda")), ("dtype", ("float32", "bfloat16")), ("matmul", MATMULS),
                              ("attention", ATTENTIONS), ("ops", OPS), ("graphs", GRAPHS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {allowed}")
        if self.graphs == "cuda" and self.device != "cuda":
            raise ValueError("CUDA graphs need --device cuda")
        if self.matmul == "int8" and self.device != "cpu":
            raise ValueError("--dtype int8 runs on the CPU only (FBGEMM)")
        if self.matmul_large and (self.matmul_large not in MATMULS or self.split_rows < 1):
            raise ValueError(f"matmul_large {self.matmul_large!r} needs a kind of {MATMULS} and split_rows >= 1")
        if {"q4", "bf16w", "gguf"} & {self.matmul, self.matmul_large} and (self.device, self.dtype) != ("cpu",
                                                                                                "float32"):
            raise ValueError("q4, bf16w and gguf matmuls run in a float32 model on the CPU only")
        if (self.attention == "fused" or self.ops == "cpu") and (self.device, self.dtype) != ("cpu", "float32"):
            raise ValueError("the fused CPU ops run float32 on the CPU only")
        if self.kv_dtype and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not one of {KV_DTYPES}")
        if self.kv_dtype not in ("", self.dtype) and self.device != "cpu":
            raise ValueError("a KV cache dtype other than the model's runs on the CPU only")
        if self.kv_dtype == "bfloat16" and (self.attention == "fused" or self.ops == "cpu"):
            raise ValueError("the fused CPU ops keep the KV cache in float32 or float16")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_dtype or self.dtype)

    def labels(self) -> dict[str, str]:
        """The plan as names, for the log line, GetInfo and the info metric."""
        return {k: str(v) for k, v in asdict(self).items()} | {"kv_dtype": self.kv_dtype or self.dtype}

    def __str__(self) -> str:
        matmuls = (f"{self.matmul} matmuls up to {self.split_rows} rows, {self.matmul_large} above"
                   if self.matmul_large else f"{self.matmul} matmuls")
        return (f"{self.device} {self.dtype}, {matmuls}, {self.attention} decode attention, "
                f"{self.ops} ops, {self.kv_dtype or self.dtype} KV cache, graphs {self.graphs}")


def for_config(config: EngineConfig) -> ExecutionPlan:
    """The engine's plan: on a CPU with dtype auto, the matmul kinds measured for its model here."""
    device = config.device if config.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    tuned = tune.tune(Path(config.model_path)) if (device, config.dtype) == ("cpu", "auto") else None
    return decide(config.device, config.dtype, config.cuda_graphs, tuned=tuned, kv_dtype=config.kv_dtype)


def decide(device: str = "auto", dtype: str = "auto", graphs: str = "auto", matmul: str = "auto",
           attention: str = "auto", tuned: tune.Tuned | None = None, kv_dtype: str = "auto") -> ExecutionPlan:
    """The plan for this machine.  device, dtype, graphs and kv_dtype as the engine's flags take them;
    matmul and attention are `auto` but for tests and benchmarks that pin one; `tuned`: the CPU kinds
    measured for the model (tune.py), else the unmeasured default."""
    device = device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "int8" and device != "cpu":
        raise ValueError("--dtype int8 runs on the CPU only (FBGEMM)")
    if dtype == "int8":
        compute = "float32"                        # int8 weights, float32 activations and KV cache
    elif dtype != "auto":
        compute = dtype
    else:
        # Measured on the 2-core AVX2 CPU here: bf16 GEMMs run at ~18 GFLOP/s against 50-120 for
        # fp32 (no native bf16), so auto means fp32 on CPU and bf16 on CUDA.
        compute = "bfloat16" if device == "cuda" else "float32"
    large, rows = "", 0
    if matmul == "auto" and tuned is not None and device == "cpu" and dtype == "auto":
        matmul, large, rows = tuned.small, tuned.large, tuned.rows
    elif matmul == "auto":
        matmul = _matmul(device, dtype)
    # The fused CPU ops agree with the torch ops to rounding, not bit for bit: "exact" keeps the torch ops.
    cpu_fusable = matmul != "exact" and device == "cpu" and compute == "float32"
    if attention == "auto":
        attention = "triton" if device == "cuda" else "fused" if cpu_fusable and cpu_ops.load() else "torch"
    elif attention == "fused" and not (cpu_fusable and cpu_ops.load()):
        raise ValueError("attention 'fused' needs the fused CPU ops: a CPU float32 model, matmul other than "
                         "'exact', and meshkernels/cpu_ops built")
    # The norm/RoPE/SiLU ops come with the attention kernels' family; "exact" keeps transformers' torch ops.
    ops = "cpu" if attention == "fused" else "triton" if attention == "triton" and matmul != "exact" else "torch"
    if graphs == "auto":
        graphs = "cuda" if device == "cuda" else "off"
    if kv_dtype == "auto":
        # float16 K and V where the fused CPU library attends (it widens them as it reads); the bit-exact
        # float32 mode and the GPU keep the model's dtype.
        kv_dtype = "float16" if attention == "fused" else compute
    return ExecutionPlan(device, compute, matmul, attention, ops, graphs, large, rows,
                         "" if kv_dtype == compute else kv_dtype)


def _matmul(device: str, dtype: str) -> str:
    if dtype == "int8":
        return "int8"
    if dtype == "auto" and device == "cpu":
        return _cpu_matmul()
    if device == "cuda" and dtype != "float32":
        return "fused"
    return "exact"                                 # an explicit float32 (or bfloat16 on the CPU)


def _cpu_matmul() -> str:
    """The CPU's GEMM kind when nothing was measured (tune.py measures for an engine's model): fp16-weight
    GEMMs with FBGEMM (1.6-2x packed fp32 for decode on an AVX2 CPU, greedy output still float32's on
    the tested prompts), else oneDNN's packed fp32."""
    if "fbgemm" in torch.backends.quantized.supported_engines:
        return "fp16w"
    return "packed" if torch.backends.mkldnn.is_available() else "exact"
