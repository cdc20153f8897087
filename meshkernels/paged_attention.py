"""Attention over a paged KV cache for a ragged batch.

The cache of one layer is `(num_blocks, block_size, kv_heads, head_dim)` for K and for V;
a request's tokens live in the blocks its block table names, in order.  Decode rows (one
query each) are attended together in one call; prefill chunks each attend their own
prefix.  `_reference()` is the plain per-sequence definition the fast paths are tested
against.  Grouped-query attention: `heads` is a multiple of `kv_heads`.  The cache may hold a
narrower dtype than the queries (float16 KV for a float32 model): rows are rounded when written
and widened to the queries' dtype when read.  `softcap` (Gemma 2; 0: off) caps each scaled score as
softcap * tanh(score / softcap) before the mask; SDPA cannot, so a capped call takes attend()'s
explicit softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store new keys/values.  slots: (T,) flat slot = block * block_size + offset; k, v: (T, KH, D)."""
    kh, d = k_cache.shape[-2:]
    k_cache.view(-1, kh, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kh, d).index_copy_(0, slots, v.to(v_cache.dtype))


def gather(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, max_blocks) block ids -> (B, KH, max_blocks * block_size, D) contiguous per row, in `dtype`
    (default: the cache's)."""
    b, nb = block_tables.shape
    bs, kh, d = cache.shape[1:]
    rows = cache.index_select(0, block_tables.reshape(-1)).view(b, nb * bs, kh, d).transpose(1, 2)
    return rows if dtype is None else rows.to(dtype)


def decode_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                dtype: torch.dtype, window: int = 0) -> torch.Tensor:
    """The additive mask decode() applies: 0 for a row's keys, -inf for the padding after them (and,
    with a sliding window, for the keys before the row's last `window`).

    (B, 1, 1, max_blocks * block_size).  The same for every layer, so callers build it once
    per step; SDPA takes a float mask as is, where a boolean one is converted on every call."""
    length = block_tables.shape[1] * block_size
    keys = torch.arange(length, device=block_tables.device)[None, :]
    mask = torch.zeros(context_lens.shape[0], length, dtype=dtype, device=block_tables.device)
    outside = keys >= context_lens[:, None]
    if window:
        outside |= keys < context_lens[:, None] - window
    return mask.masked_fill_(outside, float("-inf"))[:, None, None, :]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float = 0.0) -> torch.Tensor:
    """SDPA with grouped-query attention, or, with a softcap, the same written out as transformers' eager
    attention computes it (scores, cap, mask, float32 softmax, weighted sum).  q: (B, H, Tq, D); k, v:
    (B, KH, Tk, D); mask: boolean (True: attend) or additive, broadcast to (B, H, Tq, Tk); None: causal."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale                          # (B, H, Tq, Tk)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        tq, tk = scores.shape[-2:]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
           window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One query per row.  q: (B, H, D); block_tables: (B, max_blocks) padded with any valid id;
    context_lens: (B,) keys per row, including the current token; mask: decode_mask() of the
    same, when the caller has it; window: attend only each row's last `window` keys (0: all); softcap:
    the scores' cap (0: none).  Returns (B, H, D)."""
    k = gather(k_cache, block_tables, q.dtype)                                  # (B, KH, L, D)
    v = gather(v_cache, block_tables, q.dtype)
    if mask is None:
        mask = decode_mask(block_tables, context_lens, k_cache.shape[1], q.dtype, window)
    return attend(q.unsqueeze(2), k, v, mask, scale, softcap).squeeze(2)         # (B, H, 1, D) -> (B, H, D)


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            start: int, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """A chunk of one sequence: queries at positions start .. start+T-1 attend keys 0 .. start+T-1
    (with a sliding window, only the last `window` of them each).

    q: (T, H, D); block_table: (num_blocks,).  Returns (T, H, D)."""
    t = q.shape[0]
    k = gather(k_cache, block_table[None], q.dtype)[:, :, : start + t]           # (1, KH, S+T, D)
    v = gather(v_cache, block_table[None], q.dtype)[:, :, : start + t]
    keys = torch.arange(start + t, device=q.device)
    query = (start + torch.arange(t, device=q.device))[:, None]
    mask = keys[None, :] <= query                                                # (T, S+T) causal
    if window:
        mask &= keys[None, :] > query - window
    out = attend(q.transpose(0, 1)[None], k, v, mask, scale, softcap)             # (1, H, T, D)
    return out[0].transpose(0, 1)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
           softcap: float = 0.0) -> torch.Tensor:
    """A whole prompt from position 0, keys straight from the projection.  (T, H|KH, D) -> (T, H, D).
    window: each query attends only its last `window` positions (0: all before it)."""
    t = q.shape[0]
    mask = None                                                                  # causal
    if window and t > window:
        pos = torch.arange(t, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale, softcap)
    return out[0].transpose(0, 1)


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: list[int],
               start: int, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """The definition: softmax(cap(q k^T * scale) + causal mask) v, one sequence, float64 math; cap(s) is
    softcap * tanh(s / softcap), or s when softcap is 0.

    q: (T, H, D) for positions start .. start+T-1.  Returns (T, H, D) in q's dtype."""
    bs = k_cache.shape[1]
    t, h, _ = q.shape
    positions = start + t
    slots = [block_table[p // bs] * bs + p % bs for p in range(positions)]
    kh = k_cache.shape[2]
    k = k_cache.reshape(-1, kh, k_cache.shape[-1])[slots].double()             # (S+T, KH, D)
    v = v_cache.reshape(-1, kh, v_cache.shape[-1])[slots].double()
    k = k.repeat_interleave(h // kh, dim=1)                                      # (S+T, H, D)
    v = v.repeat_interleave(h // kh, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale                 # (H, T, S+T)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = torch.arange(positions)[None, :] <= (start + torch.arange(t))[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)
