"""The fused ops of the engine's fast forward as Triton kernels, for CUDA (and bf16).

The same three ops, with the same signatures, as the CPU library (meshkernels/cpu_ops.py), so the
model's fused forward runs on either:

- `add_rms_norm(x (T, H), residual (T, H) | None, weight (H,), eps)` -> (T, H): `x += residual`
  in place (rounded to x's dtype, as transformers adds the residual in it), then returns
  weight * RMS-normalized x, the statistics in float32.
- `rope_and_write_kv(qkv (T, H+2KH, D), positions (T,), cos (P, D), sin (P, D), k_cache, v_cache,
  slots (T,), num_heads)`: rotates q and k in place (in float32, one rounding) and stores k and v
  at `slots` of the paged cache.
- `silu_and_mul(gate_up (T, 2I))` -> (T, I): silu(gate) * up, in float32, one rounding.

Per decoder layer that is 3 launches where the torch ops take about 20 elementwise kernels: on a
GPU, a small model's decode step is launch-bound even inside a CUDA graph.  Every launch takes
its grid from tensor shapes only (no host sync; capturable).  On CPU they run under
TRITON_INTERPRET=1, which is how tests/unit/test_triton_ops.py checks them against their torch
references, meshkernels/torch_ops.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, hidden, eps, HAS_RESIDUAL: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * hidden + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * hidden + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)   # the residual stream's rounding
        tl.store(x_ptr + row * hidden + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)             # transformers rounds here
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() != 2 or not x.is_contiguous() or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm: x must be contiguous (T, H) and weight (H,); got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} must be contiguous like x {tuple(x.shape)}")
    t, hidden = x.shape
    out = torch.empty_like(x)
    if t:
        _add_rms_norm_kernel[(t,)](x, residual if residual is not None else x, weight, out, hidden, eps,
                                   HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out


@triton.jit
def _rope_write_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, num_heads, kv_heads,
                       HALF: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = 2 * HALF
    total = num_heads + 2 * kv_heads
    pos = tl.load(pos_ptr + row)
    slot = tl.load(slot_ptr + row)
    offs_i = tl.arange(0, HALF_PAD)
    valid_i = offs_i < HALF
    c = tl.load(cos_ptr + pos * d + offs_i, mask=valid_i, other=0.0).to(tl.float32)   # (HALF,) cos[:half]
    s = tl.load(sin_ptr + pos * d + offs_i, mask=valid_i, other=0.0).to(tl.float32)   # == cos[half:], sin[half:]
    # q and k heads rotate together: x * cos + cat(-x2, x1) * sin.
    heads = tl.arange(0, HEADS_PAD)
    rot = heads < num_heads + kv_heads
    mask = rot[:, None] & valid_i[None, :]
    base = qkv_ptr + row * total * d + heads[:, None] * d + offs_i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * c[None, :] - x2 * s[None, :]).to(qkv_ptr.dtype.element_ty)
    y2 = (x2 * c[None, :] + x1 * s[None, :]).to(qkv_ptr.dtype.element_ty)
    tl.store(base, y1, mask=mask)
    tl.store(base + HALF, y2, mask=mask)
    # k (rotated, from registers) and v (as is) into the cache slot: (slot, kv_head, d) of a contiguous cache.
    is_k = (heads >= num_heads) & rot
    kv_h = heads - num_heads
    dst = k_ptr + slot * kv_heads * d + kv_h[:, None] * d + offs_i[None, :]
    kmask = is_k[:, None] & valid_i[None, :]
    tl.store(dst, y1, mask=kmask)
    tl.store(dst + HALF, y2, mask=kmask)
    vh = tl.arange(0, KV_PAD)
    vmask = (vh < kv_heads)[:, None] & valid_i[None, :]
    src = qkv_ptr + row * total * d + (num_heads + kv_heads + vh[:, None]) * d + offs_i[None, :]
    vdst = v_ptr + slot * kv_heads * d + vh[:, None] * d + offs_i[None, :]
    tl.store(vdst, tl.load(src, mask=vmask, other=0.0), mask=vmask)
    tl.store(vdst + HALF, tl.load(src + HALF, mask=vmask, other=0.0), mask=vmask)


def rope_and_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> None:
    t, total, d = qkv.shape
    kv_heads = k_cache.shape[2]
    if not (qkv.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_and_write_kv: qkv and the caches must be contiguous")
    if d % 2 or total != num_heads + 2 * kv_heads or k_cache.shape[3] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"rope_and_write_kv: qkv {tuple(qkv.shape)} does not fit {num_heads} heads and a cache "
                         f"{tuple(k_cache.shape)}")
    if positions.shape != (t,) or slots.shape != (t,) or cos.shape != sin.shape or cos.shape[1] != d:
        raise ValueError("rope_and_write_kv: positions and slots need one entry per row, cos and sin (P, head_dim)")
    if t:
        _rope_write_kernel[(t,)](qkv, positions, cos, sin, k_cache, v_cache, slots, num_heads, kv_heads,
                                 HALF=d // 2, HEADS_PAD=triton.next_power_of_2(num_heads + kv_heads),
                                 KV_PAD=triton.next_power_of_2(kv_heads), HALF_PAD=triton.next_power_of_2(d // 2))


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(x_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * inter + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_and_mul: gate_up must be contiguous (T, 2I); got {tuple(gate_up.shape)}")
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
