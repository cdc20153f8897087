"""Paged decode attention as a Triton kernel: one program per (sequence, KV head[, split]).

Each program walks the sequence's block table one KV block at a time with an online
softmax, so the context is never gathered into a contiguous copy (the torch path in
paged_attention.py does gather).  It serves the query heads that share the KV head
(grouped-query attention) from one read of each K/V block.  Math is float32 whatever the
cache's dtype (bf16 on CUDA).  A softcap (Gemma 2) caps each scaled score as
softcap * tanh(score / softcap) before the softmax; without one, SOFTCAP=False compiles it out.
On CPU it runs under TRITON_INTERPRET=1, which is how the tests check it against
paged_attention._reference(); on CUDA it compiles.

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
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, stats_ptr, scale, softcap,
                   split_blocks, splits, stride_qb, stride_qh, stride_kn, stride_kt, stride_kh, stride_tb, stride_ob,
                   stride_oh,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_PAD: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + seq)
    first = split * split_blocks                                              # this program's blocks:
    last = tl.minimum(first + split_blocks, tl.cdiv(length, BLOCK_SIZE))     # [first, last), maybe none
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
    for b in range(first, last):
        block = tl.load(tables_ptr + seq * stride_tb + b).to(tl.int64)       # 64-bit: large caches
        base = block * stride_kn + kv_head * stride_kh
        kv_offs = base + offs_t[:, None] * stride_kt + offs_d[None, :]           # (T, D)
        in_context = (b * BLOCK_SIZE + offs_t) < length
        # Slots past the context are not read: whatever a reused block holds there never reaches the sum.
        kv_mask = in_context[:, None] & valid_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale        # (G, T)
        if SOFTCAP:                                      # softcap * tanh(scores / softcap); tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * (scores / softcap)) - 1.0)
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    store = valid_g[:, None] & valid_d[None, :]
    if not SPLIT:
        out = acc / denom[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store)
    else:
        # Partial results, (B, H, splits, ...) float32: the unnormalized sum, its running max and denominator.
        row = (seq * tl.num_programs(1) * GROUP + heads) * splits + split                  # (G,)
        tl.store(part_ptr + row.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store)
        tl.store(stats_ptr + row.to(tl.int64) * 2, m, mask=valid_g)
        tl.store(stats_ptr + row.to(tl.int64) * 2 + 1, denom, mask=valid_g)


@triton.jit
def _combine_kernel(part_ptr, stats_ptr, lens_ptr, out_ptr, split_blocks, splits, stride_ob, stride_oh,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                    SPLITS_PAD: tl.constexpr):
    """One program per (sequence, query head): the splits that held any of its context, rescaled to
    their common max and summed."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    length = tl.load(lens_ptr + seq)
    used = tl.cdiv(tl.cdiv(length, BLOCK_SIZE), split_blocks)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    live = offs_s < used
    row = ((seq * tl.num_programs(1) + head) * splits + offs_s).to(tl.int64)            # (S,)
    m = tl.load(stats_ptr + row * 2, mask=live, other=float("-inf"))
    denom = tl.load(stats_ptr + row * 2 + 1, mask=live, other=0.0)
    weight = tl.where(live, tl.exp(m - tl.max(m, axis=0)), 0.0)                          # (S,)
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=live[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)        # (S, D)
    out = tl.sum(part * weight[:, None], axis=0) / tl.sum(denom * weight, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


MIN_SPLIT_BLOCKS = 8      # a split walks at least this many blocks (128 tokens of 16)
MAX_SPLITS = 64


def num_splits(batch: int, kv_heads: int, width: int, multiprocessors: int) -> int:
    """How many programs share one (sequence, KV head)'s table of `width` blocks, from shapes alone (so a
    captured graph keeps its choice).  When the batch gives fewer programs than the GPU has
    multiprocessors, enough splits for two programs on each, every split walking at least
    MIN_SPLIT_BLOCKS blocks; else 1 (the combine pass would cost more than it saves).
    multiprocessors 0 (the CPU, where the interpreter runs it for tests): 1."""
    target = 2 * multiprocessors
    programs = batch * kv_heads
    if programs >= multiprocessors or width <= MIN_SPLIT_BLOCKS:
        return 1
    return max(1, min(-(-width // MIN_SPLIT_BLOCKS), -(-target // programs), MAX_SPLITS))


def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


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
           context_lens: torch.Tensor, scale: float, splits: int | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Same contract as paged_attention.decode (softcap included): q (B, H, D) -> (B, H, D).

    block_tables (B, >= max blocks) and context_lens (B,) are integer tensors on q's device;
    a row reads only the cdiv(length, block_size) first entries of its table.  splits > 1 (by
    default num_splits()) divides each table into that many ranges walked by separate programs and
    combined by a second kernel (split-K, "flash decoding"): a few long contexts then use the whole
    GPU instead of one program per KV head."""
    check(q, k_cache, v_cache, block_tables, context_lens)
    b, h, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = h // kv_heads
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    width = block_tables.shape[1]
    if splits is None:
        splits = num_splits(b, kv_heads, width, multiprocessors(q.device))
    split_blocks = max(1, -(-width // max(1, splits)))
    splits = -(-width // split_blocks) if width else 1
    part = stats = out                                   # unused unless split
    if splits > 1:
        part = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
        stats = torch.empty((b, h, splits, 2), dtype=torch.float32, device=q.device)
    _decode_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part, stats, scale, softcap, split_blocks, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_SIZE=block_size, HEAD_DIM=d,
        HEAD_PAD=triton.next_power_of_2(d), SPLIT=splits > 1, SOFTCAP=softcap > 0)
    if splits > 1:
        # Compiled per power of two of `splits` only: an eager step's varying width costs no recompiles.
        _combine_kernel[(b, h)](part, stats, context_lens, out, split_blocks, splits, out.stride(0),
                                out.stride(1), BLOCK_SIZE=block_size, HEAD_DIM=d, HEAD_PAD=triton.next_power_of_2(d),
                                SPLITS_PAD=triton.next_power_of_2(splits))
    return out
