"""Attention over the paged KV cache for one ragged batch, as the model's layers call it.

AttentionMetadata says how the flat batch's rows attend; the model runner builds it once per step
(the decode graphs over their static buffers).  Decode rows attend together in one paged call of
the plan's decode kind; each prefill chunk attends its own prefix with torch's SDPA (an explicit softmax
when the model soft-caps its scores, Gemma 2: paged_attention.attend()).

Decode kinds (ExecutionPlan.attention), a dict registry:
- torch: gather the blocks, then SDPA with a length mask (meshkernels/paged_attention.py);
- fused: the CPU library's paged_decode_attention, no gathered copies (meshkernels/cpu_ops.cpp);
- triton: the Triton paged kernel (meshkernels/paged_attention_triton.py; on CPU under its interpreter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshkernels import cpu_ops, paged_attention


@dataclass(frozen=True)
class AttentionMetadata:
    """How the flat batch's rows attend.  Built by the model runner from the scheduled chunks."""

    slots: torch.Tensor                                   # (T,) cache slot of every row
    decode_rows: torch.Tensor | None                      # (B,) rows that are single decode tokens
    decode_tables: torch.Tensor | None                    # (B, max_blocks)
    decode_lens: torch.Tensor | None                      # (B,) keys per decode row
    decode_mask: torch.Tensor | None                      # paged_attention.decode_mask() of the above; only
                                                          # the torch decode kind needs it
    prefills: tuple[tuple[int, int, int, torch.Tensor], ...]  # (first row, rows, start position, block table)


def _torch_decode() -> Callable[..., torch.Tensor]:
    return paged_attention.decode


def _fused_decode() -> Callable[..., torch.Tensor]:
    if not cpu_ops.load():
        raise ValueError("decode attention 'fused' needs meshkernels/cpu_ops built")
    return torch.ops.infermesh.paged_decode_attention  # type: ignore[no-any-return]


def _triton_decode() -> Callable[..., torch.Tensor]:
    # Imported when chosen: Triton is needed only where this kind runs (CUDA, or tests under its interpreter).
    from meshkernels import paged_attention_triton

    return paged_attention_triton.decode


# decode(q (B, H, D), k_cache, v_cache, block_tables (B, W), context_lens (B,), scale[, window][, softcap=])
# -> (B, H, D)
DECODE: dict[str, Callable[[], Callable[..., Any]]] = {"torch": _torch_decode, "fused": _fused_decode,
                                                       "triton": _triton_decode}


class Attention:
    """One layer's attention for a ragged batch, with the plan's decode kind."""

    def __init__(self, kind: str, scale: float, softcap: float = 0.0):
        self.kind = kind
        self.scale = scale
        self.softcap = softcap                    # scores -> softcap * tanh(scores / softcap); 0: off
        self._decode = DECODE[kind]()
        # Passed only when set: an uncapped model calls every kind exactly as before.
        self._cap: dict[str, float] = {"softcap": softcap} if softcap else {}
        # The torch kind masks the padding of the gathered keys; the kernels mask by length.
        self.needs_decode_mask = kind == "torch"

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, window: int = 0) -> torch.Tensor:
        """The decode rows' attention.  q: (B, H, D) -> (B, H, D).  window: attend only the last `window`
        keys (a sliding-window layer); 0: all."""
        assert meta.decode_tables is not None and meta.decode_lens is not None
        if window:
            if self.kind == "triton":
                raise ValueError("sliding-window attention is not in the Triton decode kernel yet")
            if self.needs_decode_mask:     # the step's mask is the full one: this layer builds its own
                return self._decode(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, self.scale, None,
                                    window, **self._cap)
            return self._decode(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, self.scale, window,
                                **self._cap)
        if self.needs_decode_mask:
            return self._decode(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, self.scale,
                                meta.decode_mask, **self._cap)
        return self._decode(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, self.scale, **self._cap)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0) -> torch.Tensor:
        """q: (T, heads, D), k and v: (T, kv_heads, D), already written to the cache -> (T, heads, D).
        window: a sliding-window layer's size (each query attends its last `window` positions); 0: full."""
        if meta.decode_rows is not None and not meta.prefills:
            # Pure decode step (the common case): every row is a decode row, in order.
            return self.decode(q, k_cache, v_cache, meta, window)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self.decode(q[meta.decode_rows], k_cache, v_cache, meta, window)
        for first, rows, start, table in meta.prefills:
            sl = slice(first, first + rows)
            if start == 0:
                out[sl] = paged_attention.causal(q[sl], k[sl], v[sl], self.scale, window, self.softcap)
            else:
                out[sl] = paged_attention.prefill(q[sl], k_cache, v_cache, table, start, self.scale, window,
                                                  self.softcap)
        return out
