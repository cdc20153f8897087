"""Weights in 32-weight blocks for the CPU library's q4_linear / q8_linear (meshkernels/cpu_gemm.cpp):
packing, and the torch references the tests hold the kernels to.

- q4: per block an fp16 scale d and an fp16 minimum m, and 4-bit q: weight = d * q + m (20 bytes
  per 32 weights, 5 bits a weight).
- q8: per block an fp16 scale d and int8 q: weight = d * q (34 bytes per 32 weights).

`pack_q4` / `pack_q8` also say whether the packing is lossless: a model converted from a GGUF whose
tensors were Q4_1, Q4_0 or Q8_0 (the default model's are Q4_1 and Q8_0) holds weights that are exactly
such blocks, and they come back bit for bit (Q4_0's d * (q - 8) is d * q + m with m = -8 d, which
pack_q4 tries per block when the min/max fit is not exact); then the kernels multiply by the model's
own weights and the execution plan may choose them without changing the model.  Otherwise the packed
weights are a quantized model, chosen only on request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
Q4_BYTES = 20
Q8_BYTES = 34
# GGUF types stored byte for byte as these blocks: Q4_1 is q4 (d, m, 16 bytes of nibbles, element j < 16 the low
# nibble of byte j), Q8_0 is q8.
GGUF_LAYOUTS = {"Q4_1": Q4_BYTES, "Q8_0": Q8_BYTES}


@dataclass(frozen=True)
class Packed:
    data: torch.Tensor      # (N, K / 32 * block bytes) uint8
    out_features: int
    in_features: int
    lossless: bool          # dequantizing gives back exactly the weight that was packed


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {BLOCK}: no block packing")
    return weight.detach().float().reshape(n, k // BLOCK, BLOCK)


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """(N, B) fp16 -> (N, B, 2) uint8, little-endian as the kernels read them."""
    return values.contiguous().view(torch.uint8).reshape(*values.shape, 2)


def _q4_fit(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, exact): the nearest 4-bit q for each weight under (d, m), and per block whether d * q + m gives
    every weight back exactly (as the kernels compute it, in float32)."""
    df, mf = d.float().unsqueeze(-1), m.float().unsqueeze(-1)      # d may be negative (Q4_0's often is)
    q = torch.where(df != 0, torch.round((blocks - mf) / torch.where(df != 0, df, 1.0)), 0.0).clamp(0, 15)
    return q.to(torch.uint8), (df * q + mf == blocks).all(-1)


def pack_q4(weight: torch.Tensor) -> Packed:
    blocks = _blocks(weight)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()                                   # Q4_1's fit: min and range
    q, exact = _q4_fit(blocks, d, m)
    if not bool(exact.all()):
        # Q4_0's: the weight of largest magnitude is -8 d, and m = -8 d.
        big = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)
        d0 = (big / -8).half()
        m0 = (d0.float() * -8).half()
        q0, exact0 = _q4_fit(blocks, d0, m0)
        take = ~exact & exact0
        d, m = torch.where(take, d0, d), torch.where(take, m0, m)
        q = torch.where(take.unsqueeze(-1), q0, q)
    nibbles = q[..., :16] | (q[..., 16:] << 4)                                   # (N, B, 16)
    data = torch.cat([_half_bytes(d), _half_bytes(m), nibbles], dim=-1)          # (N, B, 20)
    packed = Packed(data.reshape(blocks.shape[0], -1).contiguous(), blocks.shape[0], blocks.shape[1] * BLOCK, False)
    return Packed(packed.data, packed.out_features, packed.in_features,
                  bool(torch.equal(dequantize(packed), weight.detach().float())))


def pack_q8(weight: torch.Tensor) -> Packed:
    blocks = _blocks(weight)
    d = (blocks.abs().amax(-1) / 127).half()
    df = d.float().unsqueeze(-1)
    q = torch.where(df > 0, torch.round(blocks / torch.where(df > 0, df, 1.0)), 0.0).clamp(-127, 127)
    data = torch.cat([_half_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=-1)   # (N, B, 34)
    packed = Packed(data.reshape(blocks.shape[0], -1).contiguous(), blocks.shape[0], blocks.shape[1] * BLOCK, False)
    return Packed(packed.data, packed.out_features, packed.in_features,
                  bool(torch.equal(dequantize(packed), weight.detach().float())))


def from_gguf(data: torch.Tensor, qtype: str, in_features: int) -> Packed | None:
    """A GGUF weight's blocks ((N, row bytes) uint8) as they are, when its type `qtype` (a GGMLQuantizationType
    name) is one of GGUF_LAYOUTS: the weight itself, so lossless, without a copy; else None."""
    width = GGUF_LAYOUTS.get(qtype)
    if width is None or in_features % BLOCK or data.shape[1] != in_features // BLOCK * width:
        return None
    return Packed(data, data.shape[0], in_features, True)


def dequantize(packed: Packed) -> torch.Tensor:
    """The float32 weight (N, K) the blocks hold (the reference for the kernels)."""
    n, nb = packed.out_features, packed.in_features // BLOCK
    width = packed.data.shape[1] // nb
    raw = packed.data.reshape(n, nb, width)
    d = raw[..., 0:2].contiguous().view(torch.float16).float()                 # (N, B, 1)
    if width == Q4_BYTES:
        m = raw[..., 2:4].contiguous().view(torch.float16).float()
        nib = raw[..., 4:].to(torch.int32)
        q = torch.cat([nib & 15, nib >> 4], dim=-1).float()                     # (N, B, 32)
        w = d * q + m
    elif width == Q8_BYTES:
        q = raw[..., 2:].contiguous().view(torch.int8).float()
        w = d * q
    else:
        raise ValueError(f"{width}-byte blocks are neither q4 ({Q4_BYTES}) nor q8 ({Q8_BYTES})")
    return w.reshape(n, nb * BLOCK)


def reference_linear(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """x (T, K) float32 -> (T, N): the product the kernels compute, in torch."""
    return x.float() @ dequantize(packed).T
