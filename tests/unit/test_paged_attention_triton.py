"""The Triton paged decode kernel against the float64 per-sequence definition, `_reference()`.

Ragged batches on scattered blocks, grouped-query attention of several group sizes, a head size
that is not a power of two, bf16 caches, q as the strided view the model passes, soft-capped scores
(Gemma 2), the padded rows of the decode graphs, and the layouts check() refuses.  Run by Triton's
interpreter on this CPU.
"""

from __future__ import annotations

import os

# Triton reads this when a kernel is defined: run kernels in its interpreter on this CPU-only machine.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from meshkernels import paged_attention as pa
from meshkernels import paged_attention_triton as pat

pytestmark = pytest.mark.slow            # Triton's interpreter on the CPU (make test-fast leaves it out)

NUM_BLOCKS = 14


def make_case(kv_heads: int, heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]], list[int]]:
    """(q (B, H, D) strided view, k cache, v cache, tables, lengths): ragged lengths (one token,
    exactly one and two blocks, several blocks and a bit) on shuffled block ids."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_BLOCKS, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(NUM_BLOCKS, block_size, kv_heads, head_dim, generator=g).to(dtype)
    lens = [1, block_size, 2 * block_size + 3, 2 * block_size, 3]
    ids = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = []
    for n in lens:
        need = -(-n // block_size)
        tables.append(ids[:need])
        ids = ids[need:] + ids[:need]     # rotate: ids stay scattered, rows may share none
    # The model's q: the first H heads of a (B, H + 2 KH, D) projection, so rows are strided.
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    return qkv[:, :heads], k, v, tables, lens


def padded(tables: list[list[int]], extra: int = 2) -> torch.Tensor:
    """Rows padded by repeating their first id, wider than the longest row needs."""
    width = max(map(len, tables)) + extra
    return torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("kv_heads,heads", [(4, 4), (3, 9), (2, 16)], ids=["g1", "g3", "g8"])
def test_decode_matches_reference(kv_heads: int, heads: int, head_dim: int, block_size: int,
                                  dtype: torch.dtype) -> None:
    q, k, v, tables, lens = make_case(kv_heads, heads, head_dim, block_size, dtype, seed=head_dim + block_size)
    assert not q.is_contiguous() and q.stride(2) == 1
    scale = head_dim ** -0.5
    out = pat.decode(q, k, v, padded(tables), torch.tensor(lens), scale)
    assert out.shape == q.shape and out.dtype == dtype
    # The reference in float64 from the very values the kernel read (bf16 included).
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        ref = pa._reference(q[i:i + 1].double(), k.double(), v.double(), table, n - 1, scale)
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=tol, atol=tol, msg=f"row {i} (length {n})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [2, 3, 9])       # 9: more splits than the widest row has blocks
def test_split_k_matches_reference(splits: int, dtype: torch.dtype) -> None:
    """Split-K: each row's table in ranges walked by separate programs, then combined; ranges past a
    row's length are empty and must not count."""
    q, k, v, tables, lens = make_case(3, 9, 16, 4, dtype, seed=splits)
    scale = 16 ** -0.5
    out = pat.decode(q, k, v, padded(tables, extra=1), torch.tensor(lens), scale, splits=splits)
    whole = pat.decode(q, k, v, padded(tables, extra=1), torch.tensor(lens), scale, splits=1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), whole.float(), rtol=tol, atol=tol)
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        ref = pa._reference(q[i:i + 1].double(), k.double(), v.double(), table, n - 1, scale)
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=tol, atol=tol, msg=f"row {i} (length {n})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
def test_soft_capped_decode_matches_reference(splits: int, dtype: torch.dtype) -> None:
    """Gemma 2's softcap C (scores -> C * tanh(scores / C) before the softmax), whole and split-K, on scores
    far past C."""
    q, k, v, tables, lens = make_case(3, 9, 24, 4, dtype, seed=11)
    q = (4 * q.float()).to(dtype)
    scale = 24 ** -0.5
    out = pat.decode(q, k, v, padded(tables, extra=1), torch.tensor(lens), scale, splits=splits, softcap=3.0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        ref = pa._reference(q[i:i + 1].double(), k.double(), v.double(), table, n - 1, scale, softcap=3.0)
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=tol, atol=tol, msg=f"row {i} (length {n})")


def test_split_count_fills_the_gpu_only_when_the_batch_does_not() -> None:
    # 132 multiprocessors (an H100/H200): below 132 programs, split towards 264.
    assert pat.num_splits(1, 3, 512, 132) == 64            # one long stream: as many as allowed (64 x 8 blocks)
    assert pat.num_splits(1, 3, 32, 132) == 4              # a short table: at least 8 blocks a split
    assert pat.num_splits(16, 3, 512, 132) == 6            # 48 programs -> 6 splits each
    assert pat.num_splits(64, 4, 512, 132) == 1            # 256 programs fill it already
    assert pat.num_splits(128, 3, 512, 132) == 1
    assert pat.num_splits(1, 3, 8, 132) == 1               # nothing to split
    assert pat.num_splits(1, 3, 512, 0) == 1               # CPU
    assert pat.multiprocessors(torch.device("cpu")) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padding_rows_read_only_the_scratch_slot(dtype: torch.dtype) -> None:
    """A decode graph's padding row (table all scratch, length 1) attends exactly one slot: its
    output is that slot's V, whatever the rest of the scratch block holds; real rows beside it
    are unaffected."""
    kv_heads, heads, head_dim, block_size = 2, 6, 24, 4
    q, k, v, tables, lens = make_case(kv_heads, heads, head_dim, block_size, dtype, seed=7)
    q, tables, lens = q[:2], tables[:2], lens[:2]
    scratch = NUM_BLOCKS - 1
    tables = [t if scratch not in t else [b if b != scratch else 0 for b in t] for t in tables]
    width = 4
    rows = [t + [t[0]] * (width - len(t)) for t in tables] + [[scratch] * width] * 2
    pad_q = torch.randn(2, heads, head_dim).to(dtype) * 30      # large scores: softmax over one slot anyway
    out = pat.decode(torch.cat([q, pad_q]), k, v, torch.tensor(rows), torch.tensor(lens + [1, 1]),
                     head_dim ** -0.5)
    expected = v[scratch, 0].repeat_interleave(heads // kv_heads, dim=0)        # (H, D)
    assert torch.equal(out[2], expected) and torch.equal(out[3], expected)
    alone = pat.decode(q.contiguous(), k, v, torch.tensor(rows[:2]), torch.tensor(lens), head_dim ** -0.5)
    assert torch.equal(out[:2], alone)


def test_empty_batch_returns_an_empty_tensor() -> None:
    k = torch.randn(4, 4, 2, 16)
    out = pat.decode(torch.empty(0, 4, 16), k, k.clone(), torch.empty(0, 3, dtype=torch.int64),
                     torch.empty(0, dtype=torch.int64), 0.25)
    assert out.shape == (0, 4, 16) and out.dtype == torch.float32


def test_check_refuses_layouts_the_kernel_cannot_run() -> None:
    k = torch.zeros(4, 4, 2, 16)
    q = torch.zeros(3, 4, 16)
    tables = torch.zeros(3, 2, dtype=torch.int64)
    lens = torch.ones(3, dtype=torch.int64)
    pat.check(q, k, k.clone(), tables, lens)                       # the layout it accepts
    with pytest.raises(ValueError, match="power-of-two block size"):
        odd = torch.zeros(4, 6, 2, 16)
        pat.check(q, odd, odd.clone(), tables, lens)
    with pytest.raises(ValueError, match="same shape"):
        pat.check(q, k, torch.zeros(5, 4, 2, 16), tables, lens)
    with pytest.raises(ValueError, match="does not fit"):
        pat.check(torch.zeros(3, 5, 16), k, k.clone(), tables, lens)   # 5 heads over 2 KV heads
    with pytest.raises(ValueError, match="does not fit"):
        pat.check(torch.zeros(3, 4, 8), k, k.clone(), tables, lens)    # head size differs
    with pytest.raises(ValueError, match="block-table rows"):
        pat.check(q, k, k.clone(), tables[:2], lens)
    with pytest.raises(ValueError, match="block-table rows"):
        pat.check(q, k, k.clone(), tables, lens[:2])
    with pytest.raises(ValueError, match="power-of-two block size"):
        odd = torch.zeros(4, 6, 2, 16)
        pat.decode(q, odd, odd.clone(), tables, lens, 0.25)         # decode() checks before launching
