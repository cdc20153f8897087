"""Block-quantized linears (meshkernels/cpu_gemm.cpp) against their torch reference (meshkernels/quant.py),
the packing's losslessness on block-made weights, and the Linear kinds built on them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshkernels import cpu_ops, quant

if not cpu_ops.load():
    pytest.skip("fused CPU ops off (INFERMESH_CPU_OPS=0) or not built (see meshkernels.cpu_ops' warning)",
                allow_module_level=True)

ops = torch.ops.infermesh
ROOT = Path(__file__).resolve().parents[2]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def q4_made(n: int, k: int, seed: int) -> torch.Tensor:
    """Weights that are exactly 4-bit blocks, as a GGUF Q4_1 tensor dequantizes: d * q + m."""
    g = gen(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15                                 # the block's min and max, as a quantizer sets them
    return (d * q + m).reshape(n, k)


def q8_made(n: int, k: int, seed: int) -> torch.Tensor:
    g = gen(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)


def test_block_made_weights_pack_losslessly_and_random_ones_do_not() -> None:
    w = q4_made(48, 96, 1)
    packed = quant.pack_q4(w)
    assert packed.lossless and torch.equal(quant.dequantize(packed), w)
    assert packed.data.shape == (48, 3 * quant.Q4_BYTES) and packed.data.dtype == torch.uint8
    assert quant.pack_q8(q8_made(8, 64, 2)).lossless
    assert not quant.pack_q4(torch.randn(8, 64, generator=gen(3))).lossless
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quant.pack_q4(torch.randn(4, 40))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 33])
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_kernels_equal_their_reference(rows: int, kind: str) -> None:
    n, k = 70, 576                                               # an odd number of outputs: uneven thread split
    w = torch.randn(n, k, generator=gen(rows))
    packed = quant.pack_q4(w) if kind == "q4" else quant.pack_q8(w)
    x = torch.randn(rows, k, generator=gen(100 + rows))
    out = getattr(ops, f"{kind}_linear")(x, packed.data, n)
    torch.testing.assert_close(out, quant.reference_linear(x, packed), rtol=1e-5, atol=1e-4)


def test_lossless_blocks_multiply_by_the_models_own_weights() -> None:
    w = q4_made(64, 1536, 4)
    x = torch.randn(3, 1536, generator=gen(5))
    out = ops.q4_linear(x, quant.pack_q4(w).data, 64)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)


def test_bad_arguments_get_precise_errors() -> None:
    packed = quant.pack_q4(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="in_features 40 is not a multiple of 32"):
        ops.q4_linear(torch.randn(2, 40), packed.data, 8)
    with pytest.raises(RuntimeError, match="does not hold 9 rows"):
        ops.q4_linear(torch.randn(2, 64), packed.data, 9)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.q4_linear(torch.randn(2, 64).double(), packed.data, 8)


def q4_0_made(n: int, k: int, seed: int) -> torch.Tensor:
    """Weights that are exactly GGUF Q4_0 blocks: d * (q - 8), the largest magnitude at q = 0 (-8 d)."""
    g = gen(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    d = torch.where(torch.rand(n, k // 32, 1, generator=g) < 0.5, d, -d)
    q = torch.randint(1, 16, (n, k // 32, 32), generator=g).float()
    q[..., 3] = 0
    return (d * (q - 8)).reshape(n, k)


def test_q4_0_blocks_pack_losslessly_too() -> None:
    """pack_q4 tries Q4_0's form (m = -8 d) per block where the min/max fit is not exact."""
    w = torch.cat([q4_0_made(16, 64, 11), q4_made(16, 64, 12)])       # both kinds of block in one tensor
    packed = quant.pack_q4(w)
    assert packed.lossless and torch.equal(quant.dequantize(packed), w)
    x = torch.randn(3, 64, generator=gen(13))
    torch.testing.assert_close(torch.ops.infermesh.q4_linear(x, packed.data, 32), x @ w.T, rtol=1e-5, atol=1e-4)


def test_block_linear_kinds_fall_back_where_packing_would_change_weights() -> None:
    from services.engine.runtime.models.linear import Fp16WeightLinear, Q4Linear, Q8LayerLinear, Q8Linear

    exact, lossy = Q4Linear(q4_made(32, 64, 6), None), Q4Linear(torch.randn(32, 64, generator=gen(7)), None)
    assert exact.lossless and not lossy.lossless and isinstance(lossy.fallback, Q8LayerLinear)
    assert isinstance(lossy.fallback.fallback, Fp16WeightLinear)      # not 8-bit blocks either: fp16w
    x = torch.randn(2, 64, generator=gen(8))
    torch.testing.assert_close(lossy(x), lossy.fallback.fallback(x))
    eight = Q4Linear(q8_made(32, 64, 14), None)                     # a Q8_0 layer: its own 8-bit blocks
    assert not eight.lossless and isinstance(eight.fallback, Q8LayerLinear) and eight.fallback.lossless
    torch.testing.assert_close(eight(x), x @ q8_made(32, 64, 14).T, rtol=1e-5, atol=1e-4)
    bias = torch.randn(32, generator=gen(9))
    torch.testing.assert_close(Q4Linear(q4_made(32, 64, 6), bias)(x), x @ q4_made(32, 64, 6).T + bias,
                               rtol=1e-5, atol=1e-4)
    assert Q8Linear(q8_made(16, 64, 10), None).lossless


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_the_other_instruction_set_paths_agree(isa: str) -> None:
    """The AVX2 and portable builds (a separate library each) give the same products."""
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_ops._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    script = (
        "import torch; from meshkernels import cpu_ops, quant; assert cpu_ops.load();"
        "g = torch.Generator().manual_seed(0); w = torch.randn(37, 96, generator=g);"
        "x = torch.randn(6, 96, generator=g);"
        "[torch.testing.assert_close(getattr(torch.ops.infermesh, f'{k}_linear')(x, p.data, 37),"
        " quant.reference_linear(x, p), rtol=1e-5, atol=1e-4)"
        " for k, p in (('q4', quant.pack_q4(w)), ('q8', quant.pack_q8(w)))]; print('ok')")
    env = {**os.environ, "INFERMESH_CPU_ISA": isa, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
