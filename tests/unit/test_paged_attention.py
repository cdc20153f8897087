"""Paged attention paths against the float64 per-sequence definition, `_reference()`."""

from __future__ import annotations

import os

# Triton reads this when a kernel is defined: run kernels in its interpreter on this CPU-only machine.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from meshkernels import paged_attention as pa

BS, KH, H, D = 4, 3, 9, 16


def cache(num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, BS, KH, D, generator=g), torch.randn(num_blocks, BS, KH, D, generator=g))


# Ragged contexts on scattered, non-contiguous blocks; one ends exactly on a block boundary.
TABLES = [[5, 2, 7], [1], [0, 3, 6, 4]]
LENS = [10, 3, 16]


def decode_impl(name: str):  # type: ignore[no-untyped-def]
    if name == "triton":
        # Run by Triton's interpreter on this CPU (TRITON_INTERPRET=1 above).
        from meshkernels import paged_attention_triton

        return paged_attention_triton.decode
    return pa.decode


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_decode_matches_reference(impl: str) -> None:
    k, v = cache(8, 0)
    q = torch.randn(len(TABLES), H, D, generator=torch.Generator().manual_seed(1))
    width = max(map(len, TABLES))
    tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in TABLES])
    out = decode_impl(impl)(q, k, v, tables, torch.tensor(LENS), D ** -0.5)
    tol = 1e-5 if impl == "torch" else 1e-4   # the kernel's online softmax rescales as it goes
    for i, (table, n) in enumerate(zip(TABLES, LENS, strict=True)):
        ref = pa._reference(q[i:i + 1], k, v, table, n - 1, D ** -0.5)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_soft_capped_decode_matches_reference(impl: str) -> None:
    """Gemma 2's softcap C: scores -> C * tanh(scores / C) before the softmax; scores far past C here."""
    k, v = cache(8, 0)
    q = 4 * torch.randn(len(TABLES), H, D, generator=torch.Generator().manual_seed(1))
    width = max(map(len, TABLES))
    tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in TABLES])
    out = decode_impl(impl)(q, k, v, tables, torch.tensor(LENS), D ** -0.5, softcap=2.0)
    uncapped = decode_impl(impl)(q, k, v, tables, torch.tensor(LENS), D ** -0.5)
    assert not torch.allclose(out, uncapped, atol=0.1)
    for i, (table, n) in enumerate(zip(TABLES, LENS, strict=True)):
        ref = pa._reference(q[i:i + 1], k, v, table, n - 1, D ** -0.5, softcap=2.0)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("start,t", [(0, 5), (6, 4), (8, 1)])
def test_soft_capped_prefill_matches_reference(start: int, t: int) -> None:
    """The prefill paths with a softcap: a chunk over the cache, and a whole prompt (causal) from its keys."""
    k, v = cache(8, 2)
    q = 4 * torch.randn(t, H, D, generator=torch.Generator().manual_seed(3))
    table = [4, 0, 6]
    want = pa._reference(q, k, v, table, start, D ** -0.5, softcap=2.0)
    out = pa.prefill(q, k, v, torch.tensor(table), start, D ** -0.5, softcap=2.0)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    if start == 0:
        slots = [table[p // BS] * BS + p % BS for p in range(t)]
        keys, values = k.view(-1, KH, D)[slots], v.view(-1, KH, D)[slots]
        torch.testing.assert_close(pa.causal(q, keys, values, D ** -0.5, softcap=2.0), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("start,t", [(0, 5), (6, 4), (8, 1)])
def test_prefill_chunk_matches_reference(start: int, t: int) -> None:
    k, v = cache(8, 2)
    q = torch.randn(t, H, D, generator=torch.Generator().manual_seed(3))
    table = [4, 0, 6]
    out = pa.prefill(q, k, v, torch.tensor(table), start, D ** -0.5)
    torch.testing.assert_close(out, pa._reference(q, k, v, table, start, D ** -0.5), rtol=1e-5, atol=1e-5)


def test_write_kv_lands_in_the_named_slots() -> None:
    k, v = cache(4, 4)
    new = torch.ones(2, KH, D)
    pa.write_kv(k, v, torch.tensor([5, 14]), new, 2 * new)
    assert torch.equal(k[1, 1], new[0]) and torch.equal(v[3, 2], 2 * new[1])
