"""Paged decode attention as a Triton kernel: one program per (sequence, KV head).

Each program walks the sequence's block table one KV block at a time with an online
softmax, so the context is never gathered into a contiguous copy (the torch path in
paged_attention.py does gather).  It serves the query heads that share the KV head
(grouped-query attention) from one read of each K/V block.  Math is float32 whatever the
cache's dtype (bf16 on CUDA).  On CPU it runs under TRITON_INTERPRET=1, which is how the
tests check it against paged_attention._reference(); on CUDA it compiles.

Launch shape and loop bounds come from the tensors' shapes and from values the kernel reads
on the device (each row's context length), never from the host: a step that calls it needs
no host synchronisation and can be captured in a CUDA graph, where rows of a padded batch
point at a scratch block with length 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                   stride_qb, stride_qh, stride_kn, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_PAD: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lens_ptr + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_t = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + offs_g                                          # (G,)
    valid_g = offs_g < GROUP
    valid_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=valid_g[:, None] & valid_d[None, :], other=0.0).to(tl.float32)   # (G, D)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    denom = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_PAD), tl.float32)
    for b in range(0, tl.cdiv(length, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_tb + b).to(tl.int64)       # 64-bit: large caches
        base = block * stride_kn + kv_head * stride_kh
        kv_offs = base + offs_t[:, None] * stride_kt + offs_d[None, :]           # (T, D)
        in_context = (b * BLOCK_SIZE + offs_t) < length
        # Slots past the context are not read: whatever a reused block holds there never reaches the sum.
        kv_mask = in_context[:, None] & valid_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale        # (G, T)
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid_g[:, None] & valid_d[None, :])


def check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          context_lens: torch.Tensor) -> None:
    """The layout the kernel assumes; a mismatch is a caller's bug, so it raises ValueError at once."""
    b, h, d = q.shape
    _, block_size, kv_heads, kd = k_cache.shape
    if kd != d or h % kv_heads:
        raise ValueError(f"q (B, {h}, {d}) does not fit a cache of {kv_heads} KV heads x {kd}")
    if k_cache.stride(3) != 1:
        raise ValueError("the cache's last dimension must be contiguous")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("the K and V caches must have the same shape and strides")
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block size, not {block_size}")
    if block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(f"{b} queries need {b} block-table rows and lengths, not {block_tables.shape[0]} "
                         f"and {tuple(context_lens.shape)}")


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as paged_attention.decode: q (B, H, D) -> (B, H, D).

    block_tables (B, >= max blocks) and context_lens (B,) are integer tensors on q's device;
    a row reads only the cdiv(length, block_size) first entries of its table."""
    check(q, k_cache, v_cache, block_tables, context_lens)
    b, h, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = h // kv_heads
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    _decode_kernel[(b, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_SIZE=block_size, HEAD_DIM=d,
        HEAD_PAD=triton.next_power_of_2(d))
    return out
