"""The decoder layer's fused ops in plain torch: their definition, and the engine's torch path.

The same signatures as the fused CPU library (`torch.ops.infermesh.*`, meshkernels/cpu_ops.py) and the
Triton kernels (meshkernels/triton_ops.py), so the model's one forward runs on any of the three.  Each
is written the way transformers' LlamaForCausalLM computes it, so in the engine's "exact" mode the
output is bit for bit transformers'.  They are the references the fused kernels' tests compare
against (tests/unit/test_cpu_ops.py, tests/unit/test_triton_ops.py); paged decode attention's
float64 definition is paged_attention._reference().
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshkernels import paged_attention


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, H) += residual (T, H), in place and in x's dtype (the residual stream's rounding); returns
    weight * RMS-normalized x, the statistics in float32 and the normalized value rounded to x's dtype."""
    if residual is not None:
        x.add_(residual)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's halves: x * cos + cat(-x2, x1) * sin.  x (T, heads, D); cos, sin (T, 1, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_and_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> None:
    """qkv (T, H+2KH, D): rotate q and k in place at `positions` (cos, sin: (P, D) tables), then store
    k and v at `slots` (T,) of the paged cache (num_blocks, block_size, KH, D)."""
    kv_heads = k_cache.shape[2]
    qk = qkv[:, : num_heads + kv_heads]                                       # q and k rotate together
    qk.copy_(rope(qk, cos[positions][:, None, :], sin[positions][:, None, :]))
    paged_attention.write_kv(k_cache, v_cache, slots, qkv[:, num_heads: num_heads + kv_heads],
                             qkv[:, num_heads + kv_heads:])


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) -> (T, I): silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
