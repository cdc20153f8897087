"""The decoder layer's fused-op sets, by ExecutionPlan.ops: a dict registry of namespaces.

Each set has the same three functions with the same signatures (meshkernels/torch_ops.py documents
them): add_rms_norm (the residual add rides in the next norm), rope_and_write_kv (RoPE in place
while k and v go to the paged cache) and silu_and_mul.
- torch: meshkernels/torch_ops.py, transformers' own math (the exact mode; the references of the others);
- cpu: the fused CPU library, `torch.ops.infermesh` (meshkernels/cpu_ops.cpp), float32 on the CPU;
- triton: meshkernels/triton_ops.py, for CUDA (on CPU under Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshkernels import cpu_ops, torch_ops


def _torch() -> Any:
    return torch_ops


def _cpu() -> Any:
    if not cpu_ops.load():
        raise ValueError("ops 'cpu' need meshkernels/cpu_ops built")
    return torch.ops.infermesh


def _triton() -> Any:
    # Imported when chosen: Triton is needed only where these ops run (CUDA, or tests under its interpreter).
    from meshkernels import triton_ops

    return triton_ops


OPS: dict[str, Callable[[], Any]] = {"torch": _torch, "cpu": _cpu, "triton": _triton}


def load(kind: str) -> Any:
    """The namespace of `kind`'s add_rms_norm, rope_and_write_kv and silu_and_mul."""
    return OPS[kind]()
