"""meshkernels/triton_ops.py (the CUDA fused forward's norm, RoPE + KV write and SiLU kernels) against the
torch ops they replace, meshkernels/torch_ops.py, run by Triton's interpreter on this CPU, in float32 and bfloat16."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # read when the kernels are defined

import pytest
import torch

from meshkernels import torch_ops, triton_ops

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])            # 96: not a power of two, the tail is masked
def test_add_rms_norm_adds_in_place_and_normalizes(dtype: torch.dtype, tol: float, hidden: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    r = torch.randn(5, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    want_x = x.clone()
    want = torch_ops.add_rms_norm(want_x, r, w, 1e-5)
    got = triton_ops.add_rms_norm(x, r, w, 1e-5)
    # The residual stream, rounded as torch rounds it (on CUDA; Triton's interpreter truncates to bf16, so
    # allow one bf16 step there).
    torch.testing.assert_close(x, want_x, rtol=0 if dtype == torch.float32 else 1e-2, atol=0)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    before = x.clone()
    want = torch_ops.add_rms_norm(x.clone(), None, w, 1e-5)
    torch.testing.assert_close(triton_ops.add_rms_norm(x, None, w, 1e-5), want, rtol=tol, atol=tol)
    assert torch.equal(x, before)                         # no residual: x untouched
    assert triton_ops.add_rms_norm(x[:0], None, w, 1e-5).shape == (0, hidden)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rope_and_write_kv_matches_the_torch_ops(dtype: torch.dtype, tol: float) -> None:
    heads, kv_heads, d, bs, t = 6, 2, 16, 4, 5
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, heads + 2 * kv_heads, d, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(64).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.tensor([0, 7, 8, 30, 63])
    slots = torch.tensor([3, 9, 10, 17, 0])
    k_cache, v_cache = torch.zeros(6, bs, kv_heads, d, dtype=dtype), torch.zeros(6, bs, kv_heads, d, dtype=dtype)
    # The torch reference in float32, rounded once at the end as the kernel rounds.
    want, want_k, want_v = (t.to(torch.float32, copy=True) for t in (qkv, k_cache, v_cache))
    torch_ops.rope_and_write_kv(want, positions, cos.float(), sin.float(), want_k, want_v, slots, heads)
    want_qk, want_k, want_v = want[:, : heads + kv_heads].to(dtype), want_k.to(dtype), want_v.to(dtype)
    got = qkv.clone()
    triton_ops.rope_and_write_kv(got, positions, cos, sin, k_cache, v_cache, slots, heads)
    torch.testing.assert_close(got[:, : heads + kv_heads], want_qk, rtol=tol, atol=tol)
    assert torch.equal(got[:, heads + kv_heads:], qkv[:, heads + kv_heads:])   # v is not rotated
    torch.testing.assert_close(k_cache, want_k, rtol=tol, atol=tol)
    assert torch.equal(v_cache, want_v)
    untouched = [i for i in range(6 * bs) if i not in slots.tolist()]
    assert not k_cache.view(-1, kv_heads, d)[untouched].any()


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_and_mul(dtype: torch.dtype, tol: float) -> None:
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(dtype)   # 2 column blocks
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), rtol=tol, atol=tol)


def test_bad_shapes_are_refused_with_a_message() -> None:
    with pytest.raises(ValueError, match="weight"):
        triton_ops.add_rms_norm(torch.zeros(2, 8), None, torch.zeros(4), 1e-5)
    with pytest.raises(ValueError, match="heads"):
        triton_ops.rope_and_write_kv(torch.zeros(1, 5, 8), torch.zeros(1, dtype=torch.int64), torch.zeros(4, 8),
                                     torch.zeros(4, 8), torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8),
                                     torch.zeros(1, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="2I"):
        triton_ops.silu_and_mul(torch.zeros(2, 7))
