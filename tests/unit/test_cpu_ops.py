"""The fused CPU ops (meshkernels/cpu_ops.cpp) against their torch references: meshkernels/torch_ops.py (the
engine's torch path) and, for paged decode attention, paged_attention._reference() (float64).
The KV cache may be float16: attention widens its rows exactly, the write rounds as torch's .half()."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshkernels import cpu_ops, torch_ops
from meshkernels import paged_attention as pa

if not cpu_ops.load():
    pytest.skip("fused CPU ops off (INFERMESH_CPU_OPS=0) or not built (see meshkernels.cpu_ops' warning)",
                allow_module_level=True)

ops = torch.ops.infermesh
TOL = {"rtol": 1e-5, "atol": 1e-5}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def paged_case(lens: list[int], bs: int, kh: int, d: int, seed: int):  # type: ignore[no-untyped-def]
    """A cache with each row's blocks scattered over it; tables padded with the row's first block."""
    g = gen(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3
    k = torch.randn(num_blocks, bs, kh, d, generator=g)
    v = torch.randn(num_blocks, bs, kh, d, generator=g)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    width = max(need)
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    return k, v, tables, padded


@pytest.mark.parametrize("lens,bs,heads,kh,d", [
    ([10, 3, 16, 1, 33], 4, 9, 3, 16),     # ragged, one on a block boundary, a single key, GQA 3
    ([7], 16, 4, 4, 64),                   # one row, multi-head (no grouping)
    ([200, 64, 129, 17], 16, 9, 3, 64),    # the engine's shape (SmolLM2)
    ([40, 5], 8, 8, 1, 12),                # multi-query; head_dim not a multiple of 8 (scalar path)
    ([300, 2, 77], 16, 32, 4, 128),        # groups of 8 query heads, head_dim 128
])
def test_paged_decode_attention_matches_reference(lens: list[int], bs: int, heads: int, kh: int, d: int) -> None:
    k, v, tables, padded = paged_case(lens, bs, kh, d, seed=len(lens) + d)
    q = torch.randn(len(lens), heads, d, generator=gen(1))
    out = ops.paged_decode_attention(q, k, v, padded, torch.tensor(lens), d ** -0.5)
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        ref = pa._reference(q[i:i + 1], k, v, table, n - 1, d ** -0.5)
        torch.testing.assert_close(out[i:i + 1], ref, **TOL)


@pytest.mark.parametrize("lens,bs,heads,kh,d", [
    ([10, 3, 16, 1, 33], 4, 9, 3, 16),     # the vector path (head_dim 16 is not one of its sizes: portable)
    ([200, 64, 129, 17], 16, 9, 3, 64),    # the engine's shape: AVX-512 one-pass where the CPU has it
    ([300, 2, 77], 16, 32, 4, 128),        # groups of 8, head_dim 128
    ([31, 1], 16, 12, 12, 32),             # no grouping, head_dim 32
    ([40, 5], 8, 8, 1, 12),                # head_dim 12: the portable loops, rows converted first
])
def test_paged_decode_attention_reads_a_float16_cache(lens: list[int], bs: int, heads: int, kh: int, d: int) -> None:
    k, v, tables, padded = paged_case(lens, bs, kh, d, seed=len(lens) + d + 1)
    k, v = k.half(), v.half()
    q = torch.randn(len(lens), heads, d, generator=gen(2))
    out = ops.paged_decode_attention(q, k, v, padded, torch.tensor(lens), d ** -0.5)
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        ref = pa._reference(q[i:i + 1], k.float(), v.float(), table, n - 1, d ** -0.5)   # the widened rows
        torch.testing.assert_close(out[i:i + 1], ref, **TOL)
    # The torch decode path reads the same cache the same way.
    torch.testing.assert_close(out, pa.decode(q, k, v, padded, torch.tensor(lens), d ** -0.5), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 12])                     # the one-pass vector path and the portable one
def test_paged_decode_attention_with_a_sliding_window(dtype: torch.dtype, d: int) -> None:
    """window W: each row attends its last W keys only, as the torch path's windowed mask does."""
    lens = [40, 7, 16, 33]
    k, v, _, padded = paged_case(lens, 4, 2, d, seed=11)
    k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(len(lens), 6, d, generator=gen(5))
    n = torch.tensor(lens)
    for window in (1, 8, 16, 100):
        out = ops.paged_decode_attention(q, k, v, padded, n, 0.2, window)
        torch.testing.assert_close(out, pa.decode(q, k, v, padded, n, 0.2, window=window), **TOL)
    assert not torch.allclose(ops.paged_decode_attention(q, k, v, padded, n, 0.2, 8),
                              ops.paged_decode_attention(q, k, v, padded, n, 0.2))
    with pytest.raises(RuntimeError, match="window"):
        ops.paged_decode_attention(q, k, v, padded, n, 0.2, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [64, 12])                     # the one-pass vector path and the portable one
def test_paged_decode_attention_soft_caps_the_scores(dtype: torch.dtype, d: int) -> None:
    """softcap C (Gemma 2): each scaled score becomes C * tanh(score / C) before the softmax, as the float64
    definition has it; scores far past C here, so the cap decides.  With a window too; 0 is no cap."""
    lens = [40, 7, 16, 33]
    k, v, tables, padded = paged_case(lens, 4, 2, d, seed=13)
    k, v = (3 * k).to(dtype), v.to(dtype)
    q = 3 * torch.randn(len(lens), 6, d, generator=gen(6))
    n = torch.tensor(lens)
    out = ops.paged_decode_attention(q, k, v, padded, n, 0.3, softcap=5.0)
    for i, (table, length) in enumerate(zip(tables, lens, strict=True)):
        ref = pa._reference(q[i:i + 1], k.float(), v.float(), table, length - 1, 0.3, softcap=5.0)
        torch.testing.assert_close(out[i:i + 1], ref, **TOL)
    torch.testing.assert_close(out, pa.decode(q, k, v, padded, n, 0.3, softcap=5.0), **TOL)
    assert not torch.allclose(out, ops.paged_decode_attention(q, k, v, padded, n, 0.3), atol=0.1)
    assert torch.equal(ops.paged_decode_attention(q, k, v, padded, n, 0.3, softcap=0.0),
                       ops.paged_decode_attention(q, k, v, padded, n, 0.3))
    torch.testing.assert_close(ops.paged_decode_attention(q, k, v, padded, n, 0.3, 8, 5.0),
                               pa.decode(q, k, v, padded, n, 0.3, window=8, softcap=5.0), **TOL)
    with pytest.raises(RuntimeError, match="softcap"):
        ops.paged_decode_attention(q, k, v, padded, n, 0.3, softcap=-1.0)


def test_paged_decode_attention_takes_q_as_a_view_of_qkv() -> None:
    """The forward passes q as qkv[:, :heads]: rows strided, each head's D values contiguous."""
    lens = [5, 20]
    k, v, _, padded = paged_case(lens, 4, 2, 8, seed=7)
    qkv = torch.randn(2, 4 + 2 * 2, 8, generator=gen(2))
    q = qkv[:, :4]
    out = ops.paged_decode_attention(q, k, v, padded, torch.tensor(lens), 0.3)
    torch.testing.assert_close(out, pa.decode(q.contiguous(), k, v, padded, torch.tensor(lens), 0.3), **TOL)


def test_paged_decode_attention_refuses_bad_input() -> None:
    k, v, _, padded = paged_case([5], 4, 1, 8, seed=3)
    q = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="float32"):
        ops.paged_decode_attention(q.double(), k, v, padded, torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="context_lens"):
        ops.paged_decode_attention(q, k, v, padded, torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="not a block id"):
        ops.paged_decode_attention(q, k, v, torch.full_like(padded, k.shape[0]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        ops.paged_decode_attention(q, k.bfloat16(), v.bfloat16(), padded, torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="differ"):
        ops.paged_decode_attention(q, k, v.half(), padded, torch.tensor([5]), 1.0)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (16, 576), (300, 576), (5, 37)])
def test_add_rms_norm_adds_in_place_and_normalizes(rows: int, hidden: int) -> None:
    g = gen(rows)
    x, r = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    summed = x.clone()
    want = torch_ops.add_rms_norm(summed, r, w, 1e-5)
    out = ops.add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(x, summed, rtol=0, atol=0)      # the add is exact
    torch.testing.assert_close(out, want, **TOL)


def test_rms_norm_without_residual_leaves_x_alone() -> None:
    x, w = torch.randn(3, 64, generator=gen(0)), torch.randn(64, generator=gen(1))
    before = x.clone()
    out = ops.add_rms_norm(x, None, w, 1e-6)
    assert torch.equal(x, before)
    torch.testing.assert_close(out, torch_ops.add_rms_norm(x.clone(), None, w, 1e-6), **TOL)


def rope_tables(positions: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("t,heads,kh,d", [(1, 9, 3, 64), (16, 9, 3, 64), (70, 4, 2, 12), (3, 2, 1, 6)])
def test_rope_and_write_kv(t: int, heads: int, kh: int, d: int) -> None:
    g = gen(t)
    bs, num_blocks = 4, 40
    cos, sin = rope_tables(128, d)
    qkv = torch.randn(t, heads + 2 * kh, d, generator=g)
    positions = torch.randint(0, 128, (t,), generator=g)
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    k_cache, v_cache = torch.zeros(num_blocks, bs, kh, d), torch.zeros(num_blocks, bs, kh, d)

    want = qkv.clone()
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    torch_ops.rope_and_write_kv(want, positions, cos, sin, ref_k, ref_v, slots, heads)
    expected_v = qkv[:, heads + kh:].clone()

    ops.rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, heads)
    torch.testing.assert_close(qkv[:, : heads + kh], want[:, : heads + kh], **TOL)
    assert torch.equal(qkv[:, heads + kh:], expected_v)            # v is not rotated
    torch.testing.assert_close(k_cache, ref_k, **TOL)
    assert torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("t,heads,kh,d", [(16, 9, 3, 64), (3, 2, 1, 6)])
def test_rope_and_write_kv_into_a_float16_cache(t: int, heads: int, kh: int, d: int) -> None:
    """Rounded to nearest even, as torch's .half() rounds: the torch path writes the same bits."""
    g = gen(t + 100)
    cos, sin = rope_tables(128, d)
    qkv = torch.randn(t, heads + 2 * kh, d, generator=g) * 300.0     # some values lose mantissa bits
    qkv[0, heads, 0] = 1e-6                                          # a subnormal half
    qkv[0, heads + kh, 0] = 70000.0                                  # beyond float16: inf, as .half()
    positions = torch.randint(0, 128, (t,), generator=g)
    slots = torch.randperm(40 * 4, generator=g)[:t]
    k_cache, v_cache = torch.zeros(40, 4, kh, d, dtype=torch.float16), torch.zeros(40, 4, kh, d, dtype=torch.float16)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want = qkv.clone()
    torch_ops.rope_and_write_kv(want, positions, cos, sin, ref_k, ref_v, slots, heads)
    ops.rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, heads)
    assert torch.equal(v_cache, ref_v)
    torch.testing.assert_close(k_cache.float(), ref_k.float(), rtol=1e-3, atol=1e-6)   # k: rotations agree to rounding
    assert torch.equal(v_cache.view(-1, kh, d)[slots], qkv[:, heads + kh:].half())


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_the_other_instruction_set_paths_attend_alike(isa: str) -> None:
    """The AVX2 and portable builds read and write float16 caches (and soft-cap) as the native one does."""
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_ops._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    script = (
        "import torch; from meshkernels import cpu_ops, paged_attention as pa; assert cpu_ops.load();"
        "g = torch.Generator().manual_seed(0); ops = torch.ops.infermesh;"
        "k = torch.randn(20, 16, 3, 64, generator=g).half(); v = torch.randn(20, 16, 3, 64, generator=g).half();"
        "q = torch.randn(2, 9, 64, generator=g); t = torch.randperm(20, generator=g)[:10].view(2, 5);"
        "n = torch.tensor([70, 33]); out = ops.paged_decode_attention(q, k, v, t, n, 0.125);"
        "torch.testing.assert_close(out, pa.decode(q, k.float(), v.float(), t, n, 0.125), rtol=1e-5, atol=1e-5);"
        "out = ops.paged_decode_attention(q, k, v, t, n, 0.5, softcap=2.0);"
        "torch.testing.assert_close(out, pa.decode(q, k.float(), v.float(), t, n, 0.5, softcap=2.0), rtol=1e-5,"
        " atol=1e-5);"
        "x = torch.randn(3, 15, 64, generator=g) * 1000; kc = torch.zeros(4, 4, 3, 64, dtype=torch.float16);"
        "vc = torch.zeros_like(kc); c = torch.ones(8, 64); s = torch.zeros(8, 64);"
        "ops.rope_and_write_kv(x, torch.tensor([0, 1, 2]), c, s, kc, vc, torch.tensor([0, 5, 9]), 9);"
        "assert torch.equal(kc.view(-1, 3, 64)[[0, 5, 9]], x[:, 9:12].half());"
        "assert torch.equal(vc.view(-1, 3, 64)[[0, 5, 9]], x[:, 12:].half()); print('ok')")
    env = {**os.environ, "INFERMESH_CPU_ISA": isa, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_rope_refuses_positions_past_the_table() -> None:
    cos, sin = rope_tables(8, 4)
    cache = torch.zeros(2, 4, 1, 4)
    with pytest.raises(RuntimeError, match="RoPE table"):
        ops.rope_and_write_kv(torch.zeros(1, 3, 4), torch.tensor([8]), cos, sin, cache, cache.clone(),
                              torch.tensor([0]), 1)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (16, 1536), (300, 1536), (7, 13)])
def test_silu_and_mul(rows: int, inter: int) -> None:
    gate_up = torch.randn(rows, 2 * inter, generator=gen(rows)) * 8     # reaches both exp tails
    torch.testing.assert_close(ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), **TOL)


def test_silu_saturates_without_nan() -> None:
    gate_up = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0] + [1.0] * 6])
    torch.testing.assert_close(ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), **TOL)


def test_ops_refuse_non_contiguous_input() -> None:
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.silu_and_mul(torch.randn(8, 4).t())
