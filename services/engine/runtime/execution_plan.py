"""The ExecutionPlan itself: which device, dtype, matmul kind, kernels and graph mode an engine runs, and the
names each field takes.  A leaf (torch and the config's names only): the model imports it, and
plan.py, which decides a plan (measuring with tune.py, which times the model's
own layers), imports the model's modules in turn.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from services.engine.config import GRAPHS

MATMULS = ("exact", "fused", "packed", "fp16w", "int8", "q4", "bf16w", "gguf", "ggufr")
GGUF_MATMULS = ("gguf", "ggufr")   # a GGUF's own blocks: as the file lays them out, or repacked 16 rows at a time
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
        if {"q4", "bf16w", *GGUF_MATMULS} & {self.matmul, self.matmul_large} and (self.device, self.dtype) != (
                "cpu", "float32"):
            raise ValueError("q4, bf16w, gguf and ggufr matmuls run in a float32 model on the CPU only")
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
