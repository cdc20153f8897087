"""GGUF Q8_0 / Q5_0 blocks times int8 activations (kernels/cpu_gguf.cpp) against gguf-py's layouts and
the torch references in kernels/gguf_blocks.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kernels import cpu_ops, gguf_blocks

if not cpu_ops.load():
    pytest.skip("fused CPU ops off (INFERMESH_CPU_OPS=0) or not built (see kernels.cpu_ops' warning)",
                allow_module_level=True)

ops = torch.ops.infermesh
ROOT = Path(__file__).resolve().parents[2]


def random_blocks(n: int, k: int, kind: int, seed: int) -> np.ndarray:
    """(N, K / 32 * bytes) uint8 of random blocks: fp16 d of either sign, random q (every bit pattern,
    Q8_0's -128 included)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = (rng.uniform(1e-3, 2e-2, (n, nb, 1)) * rng.choice([-1.0, 1.0], (n, nb, 1))).astype(np.float16)
    if kind == gguf_blocks.Q8_0:
        rest = rng.integers(-128, 128, (n, nb, 32)).astype(np.int8).view(np.uint8)
    else:
        rest = rng.integers(0, 256, (n, nb, 20)).astype(np.uint8)        # qh (4 bytes) and qs (16)
    return np.concatenate([d.view(np.uint8), rest], axis=-1).reshape(n, -1)


def spec_weights(raw: np.ndarray, kind: int) -> np.ndarray:
    """The weights per the layout as written in kernels/cpu_gguf.cpp, element by element."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, gguf_blocks.block_bytes(kind))
    out = np.zeros((n, blocks.shape[1], 32), np.float32)
    for i in range(n):
        for b in range(blocks.shape[1]):
            blk = blocks[i, b]
            d = np.float32(blk[:2].view(np.float16)[0])
            if kind == gguf_blocks.Q8_0:
                q = blk[2:].view(np.int8).astype(np.int32)
            else:
                qh = int(blk[2:6].view("<u4")[0])
                qs = blk[6:22].astype(np.int32)
                q = np.array([(qs[j] & 15) | (((qh >> j) & 1) << 4) for j in range(16)]
                             + [(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) for j in range(16)]) - 16
            out[i, b] = d * q.astype(np.float32)
    return out.reshape(n, -1)


@pytest.mark.parametrize("kind", [gguf_blocks.Q8_0, gguf_blocks.Q5_0])
def test_layouts_match_gguf_py(kind: int) -> None:
    raw = random_blocks(5, 128, kind, seed=kind)
    qtype = gguf_blocks.KINDS[kind][0]
    expected = gguf_dequantize(raw, qtype)
    np.testing.assert_array_equal(spec_weights(raw, kind), expected)
    np.testing.assert_array_equal(gguf_blocks.dequantize(gguf_blocks.blocks_from_array(raw, kind), kind).numpy(),
                                  expected)
    # and gguf-py's own quantizer writes blocks of this layout
    w = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    q = gguf_quantize(w, qtype)
    assert q.shape == (3, 2 * gguf_blocks.block_bytes(kind))
    np.testing.assert_array_equal(spec_weights(q, kind), gguf_dequantize(q, qtype))


def test_blocks_come_out_of_a_gguf_file_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    raws = {kind: random_blocks(6, 96, kind, seed=10 + kind) for kind in gguf_blocks.KINDS}
    for kind, raw in raws.items():
        writer.add_tensor(f"w{kind}", raw, raw_dtype=gguf_blocks.KINDS[kind][0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for tensor in GGUFReader(str(path)).tensors:
        blocks, kind = gguf_blocks.blocks_from_reader_tensor(tensor)
        assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
        assert torch.equal(blocks, torch.from_numpy(raws[kind]))
    with pytest.raises(ValueError, match="not supported"):
        gguf_blocks.kind_of(GGMLQuantizationType.Q4_0)


def check_against_references(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> None:
    out = gguf_blocks.gguf_linear(x, blocks, kind)
    w = gguf_blocks.dequantize(blocks, kind)
    q, d = gguf_blocks.quantize_activations(x)
    t, k = x.shape
    xq = (q.double().reshape(t, -1, 32) * d.double().unsqueeze(-1)).reshape(t, k)
    # against the int8-activation product: float32 rounding of the block sums only
    rounding = 2e-6 * (xq.abs() @ w.double().abs().T) + 1e-6
    assert bool(((out.double() - gguf_blocks.gguf_linear_reference(x, blocks, kind).double()).abs()
                 <= rounding).all())
    # against x @ W^T: within the activations' quantization error (<= dx / 2 per element)
    half_step = (d.double() / 2).repeat_interleave(32, dim=1)
    quantization = half_step @ w.double().abs().T
    assert bool(((out.double() - (x.double() @ w.double().T)).abs()
                 <= quantization * (1 + 1e-6) + rounding + 2e-6 * (x.double().abs() @ w.double().abs().T)).all())
    assert bool((quantization <= (x.double().abs().amax(1, keepdim=True) / 254) @ w.double().abs().sum(1)[None]
                 * (1 + 1e-6)).all())


@pytest.mark.parametrize("rows", [1, 3, 4, 16, 33])
@pytest.mark.parametrize("shape", [(64, 7), (96, 9), (896, 50), (4864, 24)])
@pytest.mark.parametrize("kind", [gguf_blocks.Q8_0, gguf_blocks.Q5_0])
def test_kernel_matches_references(rows: int, shape: tuple[int, int], kind: int) -> None:
    k, n = shape
    blocks = gguf_blocks.blocks_from_array(random_blocks(n, k, kind, seed=rows * 7 + k), kind)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    x[0, :32] = 0.0                                      # a block of zeros: dx = 0
    check_against_references(x, blocks, kind)


@pytest.mark.parametrize("kind", [gguf_blocks.Q8_0, gguf_blocks.Q5_0])
def test_gguf_quantized_weights(kind: int) -> None:
    """Blocks as gguf-py's quantizer writes them from float weights, on an even N."""
    w = np.random.default_rng(3).standard_normal((64, 896)).astype(np.float32) * 0.05
    blocks = gguf_blocks.blocks_from_array(gguf_quantize(w, gguf_blocks.KINDS[kind][0]), kind)
    x = torch.randn(5, 896, generator=torch.Generator().manual_seed(4))
    check_against_references(x, blocks, kind)


def test_bad_arguments_get_precise_errors() -> None:
    blocks = gguf_blocks.blocks_from_array(random_blocks(8, 64, 8, seed=0), 8)
    out = torch.empty(2, 8)
    with pytest.raises(RuntimeError, match="in_features 40 is not a multiple of 32"):
        ops.gguf_linear(torch.randn(2, 40), blocks, 8, out)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.gguf_linear(torch.randn(2, 64).double(), blocks, 8, out)
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        ops.gguf_linear(torch.randn(2, 64), blocks.view(torch.int8), 8, out)
    with pytest.raises(RuntimeError, match="do not hold rows of 2 Q5_0 blocks of 22 bytes"):
        ops.gguf_linear(torch.randn(2, 64), blocks, 5, out)
    with pytest.raises(RuntimeError, match="kind must be 8 .Q8_0. or 5 .Q5_0., got 6"):
        ops.gguf_linear(torch.randn(2, 64), blocks, 6, out)
    with pytest.raises(RuntimeError, match=r"out must have shape \(3, 8\)"):
        ops.gguf_linear(torch.randn(3, 64), blocks, 8, out)
    with pytest.raises(ValueError, match="kind must be 8"):
        gguf_blocks.gguf_linear(torch.randn(2, 64), blocks, 4)


@pytest.mark.parametrize("isa", ["avxvnni", "avx2", "portable"])
def test_the_other_instruction_set_paths_agree(isa: str) -> None:
    """The AVX-VNNI (256-bit, no AVX-512), AVX2 and portable builds (a separate library each) pass the
    same checks."""
    if isa != "portable" and not {"avx2", "fma", "f16c"} <= cpu_ops._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if isa == "avxvnni" and "avx_vnni" not in cpu_ops._cpu_flags():
        pytest.skip("this CPU has no AVX-VNNI")
    script = (
        "import torch; from kernels import cpu_ops, gguf_blocks; assert cpu_ops.load();"
        "from tests.unit.test_gguf_blocks import random_blocks, check_against_references;"
        "[check_against_references(torch.randn(t, 96, generator=torch.Generator().manual_seed(t)),"
        " gguf_blocks.blocks_from_array(random_blocks(37, 96, kind, seed=t), kind), kind)"
        " for kind in (8, 5) for t in (1, 3, 6, 9, 16)]; print('ok')")
    env = {**os.environ, "INFERMESH_CPU_ISA": isa, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
