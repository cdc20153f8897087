"""The ExecutionPlan: which device, dtype, matmul kind, kernels and graph mode an engine runs.

The config says what was asked for (mostly `auto`); decide() turns that into one frozen plan for
this machine, once, at start.  The model runner and the model only follow it; the engine logs it,
GetInfo reports it and /metrics exports it (infermesh_engine_plan_info).  Nothing else chooses a
fast path.

What `auto` means today:
- CPU: float32; the matmul kinds measured fastest on this machine for the model's shapes
  (services/engine/runtime/tune.py, cached): typically `q4` (the model's own 4-bit blocks) for small
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

from pathlib import Path

import torch

from meshkernels import cpu_ops
from services.engine.config import EngineConfig
from services.engine.runtime import tune
from services.engine.runtime.execution_plan import ATTENTIONS, KV_DTYPES, MATMULS, OPS, ExecutionPlan
from services.engine.runtime.models.linear import bf16w_runs

# The plan and its fields' names (execution_plan.py: a leaf, so the model can import it without this module).
__all__ = ["ATTENTIONS", "KV_DTYPES", "MATMULS", "OPS", "ExecutionPlan", "decide", "for_config"]


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
    if "bf16w" in (matmul, large) and not bf16w_runs():
        raise ValueError("matmul 'bf16w' needs a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT for oneDNN's bf16 "
                         "weights; this one has neither: use 'fp16w', 'q4' or 'auto'")
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
