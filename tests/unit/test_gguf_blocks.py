"""GGUF Q4_1 / Q5_0 / Q8_0 / Q4_K / Q5_K / Q6_K blocks times int8 activations (meshkernels/cpu_gguf.cpp, its AMX path
cpu_gguf_amx.cpp) against gguf-py's layouts and the torch references in meshkernels/gguf_blocks.py."""

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

from meshkernels import cpu_ops, gguf_blocks

if not cpu_ops.load():
    pytest.skip("fused CPU ops off (INFERMESH_CPU_OPS=0) or not built (see meshkernels.cpu_ops' warning)",
                allow_module_level=True)

ops = torch.ops.infermesh
ROOT = Path(__file__).resolve().parents[2]


D_FIELDS = {gguf_blocks.Q4_1: [0, 2], gguf_blocks.Q8_0: [0], gguf_blocks.Q5_0: [0], gguf_blocks.Q4_K: [0, 2],
            gguf_blocks.Q5_K: [0, 2], gguf_blocks.Q6_K: [208]}   # byte offsets of each block's fp16 scales
EXTREME_D = [65504.0, -65504.0, 6.104e-5, 6e-8, -6e-8, 0.0, 1.0, -2.0]


def random_blocks(n: int, k: int, kind: int, seed: int, extreme: bool = False) -> np.ndarray:
    """(N, K / weights * bytes) uint8 of random valid blocks: every q, scale and min bit pattern (Q8_0's
    -128 included), fp16 scales of either sign; `extreme`: scales from fp16's largest to subnormal and
    zero, and blocks whose other bytes are all 0x00, 0x80 or 0xFF."""
    rng = np.random.default_rng(seed)
    info = gguf_blocks.KINDS[kind]
    nb = k // info.weights
    raw = rng.integers(0, 256, (n, nb, info.bytes)).astype(np.uint8)
    if extreme:
        fill = rng.choice([-1, 0x00, 0x80, 0xFF], (n, nb))
        for value in (0x00, 0x80, 0xFF):
            raw[fill == value] = value
    for at in D_FIELDS[kind]:
        if extreme:
            d = rng.choice(EXTREME_D, (n, nb))
        else:
            d = rng.uniform(1e-3, 2e-2, (n, nb)) * rng.choice([-1.0, 1.0], (n, nb))
        raw[:, :, at:at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def f16(b: np.ndarray) -> np.float32:
    return np.float32(b.view(np.float16)[0])


def spec_block(blk: np.ndarray, kind: int) -> np.ndarray:
    """One block's weights per the layout as written in meshkernels/cpu_gguf.cpp, element by element (float32
    products in gguf-py's order)."""
    if kind == gguf_blocks.Q8_0:
        return f16(blk[:2]) * blk[2:].view(np.int8).astype(np.float32)
    if kind == gguf_blocks.Q4_1:
        qs = blk[4:20].astype(np.int32)
        q = np.array([qs[j] & 15 for j in range(16)] + [qs[j] >> 4 for j in range(16)])
        return f16(blk[:2]) * q.astype(np.float32) + f16(blk[2:4])
    if kind == gguf_blocks.Q5_0:
        qh = int(blk[2:6].view("<u4")[0])
        qs = blk[6:22].astype(np.int32)
        q = np.array([(qs[j] & 15) | (((qh >> j) & 1) << 4) for j in range(16)]
                     + [(qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) for j in range(16)]) - 16
        return f16(blk[:2]) * q.astype(np.float32)
    if kind == gguf_blocks.Q6_K:
        ql, qh, sc = blk[:128].astype(np.int32), blk[128:192].astype(np.int32), blk[192:208].view(np.int8)
        out = np.zeros(256, np.float32)
        for h, g, i in np.ndindex(2, 4, 32):
            q = ((ql[64 * h + 32 * (g & 1) + i] >> (4 * (g >> 1))) & 15) | (((qh[32 * h + i] >> (2 * g)) & 3) << 4)
            e = 128 * h + 32 * g + i
            out[e] = (f16(blk[208:210]) * np.float32(sc[e // 16])) * np.float32(q - 32)
        return out
    s = blk[4:16].astype(np.int32)                      # Q4_K / Q5_K
    qh, qs = (blk[16:48].astype(np.int32), blk[48:176]) if kind == gguf_blocks.Q5_K else (None, blk[16:144])
    out = np.zeros(256, np.float32)
    for j in range(8):
        sc, m = ((s[j] & 63, s[j + 4] & 63) if j < 4 else
                 ((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)))
        for i in range(32):
            q = (int(qs[32 * (j // 2) + i]) >> (4 * (j % 2))) & 15
            if qh is not None:
                q |= ((qh[i] >> j) & 1) << 4
            out[32 * j + i] = (f16(blk[:2]) * np.float32(sc)) * np.float32(q) - f16(blk[2:4]) * np.float32(m)
    return out


def spec_weights(raw: np.ndarray, kind: int) -> np.ndarray:
    blocks = raw.reshape(raw.shape[0], -1, gguf_blocks.block_bytes(kind))
    return np.stack([np.concatenate([spec_block(blk, kind) for blk in row]) for row in blocks])


@pytest.mark.parametrize("kind", list(gguf_blocks.KINDS))
def test_layouts_match_gguf_py(kind: int) -> None:
    qtype = gguf_blocks.KINDS[kind].qtype
    for extreme in (False, True):
        raw = random_blocks(5, 512, kind, seed=kind, extreme=extreme)
        expected = gguf_dequantize(raw, qtype)
        np.testing.assert_array_equal(spec_weights(raw, kind), expected)
        np.testing.assert_array_equal(
            gguf_blocks.dequantize(gguf_blocks.blocks_from_array(raw, kind), kind).numpy(), expected)
    if kind in (gguf_blocks.Q8_0, gguf_blocks.Q5_0, gguf_blocks.Q4_1):   # gguf-py's quantizer writes these
        w = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
        q = gguf_quantize(w, qtype)
        assert q.shape == (3, 2 * gguf_blocks.block_bytes(kind))
        np.testing.assert_array_equal(spec_weights(q, kind), gguf_dequantize(q, qtype))


def test_kinds_are_ggml_type_ids() -> None:
    for name in ("Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        qtype = GGMLQuantizationType[name]
        assert getattr(gguf_blocks, name) == int(qtype) and gguf_blocks.kind_of(qtype) == int(qtype)
        assert gguf_blocks.kind_of(int(qtype)) == int(qtype)
    ids = (gguf_blocks.Q4_1, gguf_blocks.Q5_0, gguf_blocks.Q8_0, gguf_blocks.Q4_K, gguf_blocks.Q5_K, gguf_blocks.Q6_K)
    assert ids == (3, 6, 8, 12, 13, 14)
    assert {k: (v.bytes, v.weights) for k, v in gguf_blocks.KINDS.items()} == {
        3: (20, 32), 6: (22, 32), 8: (34, 32), 12: (144, 256), 13: (176, 256), 14: (210, 256)}


def test_blocks_come_out_of_a_gguf_file_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    raws = {kind: random_blocks(6, 512, kind, seed=10 + kind) for kind in gguf_blocks.KINDS}
    for kind, raw in raws.items():
        writer.add_tensor(f"w{kind}", raw, raw_dtype=gguf_blocks.KINDS[kind].qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = GGUFReader(str(path)).tensors
    assert len(tensors) == len(raws)
    for tensor in tensors:
        blocks, kind = gguf_blocks.blocks_from_reader_tensor(tensor)
        assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
        assert torch.equal(blocks, torch.from_numpy(raws[kind]))
    with pytest.raises(ValueError, match="not supported"):
        gguf_blocks.kind_of(GGMLQuantizationType.Q4_0)


def activation_block(kind: int, rows: int) -> int:
    """Elements per activation scale in the kernel's product: 256 where cpu_gguf_q8k.cpp runs (Q4_K and Q6_K
    at 1-4 rows, AVX512-VNNI builds), as llama.cpp's Q8_K activations for K-quants; else 32.  A dx per 256
    is coarser, so there the per-256 reference is the one the output must match within float rounding."""
    flags = cpu_ops._cpu_flags()
    q8k = ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"} <= flags
           and os.environ.get("INFERMESH_CPU_ISA", "native") in ("native", "avx512"))
    return 256 if q8k and kind in (gguf_blocks.Q4_K, gguf_blocks.Q6_K) and 1 <= rows <= 4 else 32


def check_against_references(x: torch.Tensor, blocks: torch.Tensor, kind: int, repacked: bool = False,
                             outliers: bool = False) -> None:
    """The op's product against the references; `repacked`: by the blocks repack()ed (activations per 32 there),
    with `outliers` kept as floats."""
    if repacked:
        out = torch.empty(x.shape[0], blocks.shape[0])
        ops.gguf_linear(x, gguf_blocks.repack(blocks, kind),
                        kind + gguf_blocks.REPACKED + (gguf_blocks.OUTLIERS if outliers else 0), out)
    else:
        out = gguf_blocks.gguf_linear(x, blocks, kind)
    w = gguf_blocks.dequantize(blocks, kind)
    t, k = x.shape
    block = 32 if repacked else activation_block(kind, t)
    q, d = gguf_blocks.quantize_activations(x, block)
    xq = (gguf_blocks.fine_activations(x) if outliers
          else (q.double().reshape(t, -1, block) * d.double().unsqueeze(-1)).reshape(t, k))
    # against the int8-activation product: float32 rounding of the block sums only
    rounding = 2e-6 * (xq.abs() @ w.double().abs().T) + 1e-6
    reference = gguf_blocks.gguf_linear_reference(x, blocks, kind, block, fine=outliers)
    assert bool(((out.double() - reference.double()).abs() <= rounding).all())
    # against x @ W^T: within the activations' quantization error (<= dx / 2 per element)
    half_step = (d.double() / 2).repeat_interleave(block, dim=1)
    quantization = half_step @ w.double().abs().T
    assert bool(((out.double() - (x.double() @ w.double().T)).abs()
                 <= quantization * (1 + 1e-6) + rounding + 2e-6 * (x.double().abs() @ w.double().abs().T)).all())
    assert bool((quantization <= (x.double().abs().amax(1, keepdim=True) / 254) @ w.double().abs().sum(1)[None]
                 * (1 + 1e-6)).all())


SHAPES = {32: [(64, 7), (96, 9), (896, 50), (4864, 24)], 256: [(256, 7), (512, 9), (1536, 50), (4864, 24)]}


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 16, 33])
@pytest.mark.parametrize("shape", range(4))
@pytest.mark.parametrize("kind", list(gguf_blocks.KINDS))
def test_kernel_matches_references(rows: int, shape: int, kind: int) -> None:
    k, n = SHAPES[gguf_blocks.KINDS[kind].weights][shape]
    blocks = gguf_blocks.blocks_from_array(random_blocks(n, k, kind, seed=rows * 7 + k), kind)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    x[0, :32] = 0.0                                      # a block of zeros: dx = 0
    check_against_references(x, blocks, kind)


@pytest.mark.parametrize("rows", [1, 4, 9, 33])
@pytest.mark.parametrize("shape", range(4))
@pytest.mark.parametrize("kind", list(gguf_blocks.KINDS))
def test_repacked_kernel_matches_references(rows: int, shape: int, kind: int) -> None:
    """Blocks repacked 16 rows at a time (cpu_gguf_r16.cpp), N a multiple of 16 or not (the last rows stay as
    the file has them), extreme scales in one shape: the same product."""
    k, n = SHAPES[gguf_blocks.KINDS[kind].weights][shape]
    blocks = gguf_blocks.blocks_from_array(random_blocks(n, k, kind, seed=rows * 5 + k, extreme=shape == 1), kind)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + n))
    x[0, :32] = 0.0
    check_against_references(x, blocks, kind, repacked=True)


def check_full_scale(kind: int) -> None:
    """Every weight at its largest unsigned value (bytes 0xFF) against activations all +1 or all -1 (every qx
    +-127): the products' 16-bit pair sums at their bound (cpu_gguf_r16_narrow.h's pair_sums), exact."""
    k = 512 if gguf_blocks.KINDS[kind].weights == 256 else 96
    raw = np.full((37, k // gguf_blocks.KINDS[kind].weights, gguf_blocks.KINDS[kind].bytes), 0xFF, np.uint8)
    for at in D_FIELDS[kind]:
        raw[:, :, at:at + 2] = np.full(raw.shape[:2], 0.01, np.float16)[..., None].view(np.uint8)
    blocks = gguf_blocks.blocks_from_array(raw.reshape(37, -1), kind)
    for t in (1, 5):
        for sign in (1.0, -1.0):
            check_against_references(torch.full((t, k), sign), blocks, kind, repacked=True)


@pytest.mark.parametrize("kind", list(gguf_blocks.KINDS))
def test_repacked_products_at_full_scale(kind: int) -> None:
    check_full_scale(kind)


def with_outliers(x: torch.Tensor) -> torch.Tensor:
    """x with outlier channels, as an LLM's hidden state has them: a few elements 12-40x the rest, in some
    rows only, one channel twice in a block, and a tie for the largest |x| (the first is the outlier)."""
    x = x.clone()
    k = x.shape[1]
    x[:, 5] = 40.0
    x[::2, k // 2 + 3] = -12.0
    x[-1, k - 2] = x[-1, k - 1] = 30.0
    if k >= 96:
        x[0, 64] = -25.0
        x[0, 70] = 25.0
    return x


@pytest.mark.parametrize("rows", [1, 4, 9, 33])
@pytest.mark.parametrize("kind", list(gguf_blocks.KINDS))
def test_repacked_products_keep_outliers_as_floats(rows: int, kind: int) -> None:
    """A block with an outlier channel: the repacked products with OUTLIERS take the element out and multiply it
    as a float, the other 31 quantized alone (the last N % 16 rows too), closer to x W^T than int8 of the whole
    block."""
    k = 512 if gguf_blocks.KINDS[kind].weights == 256 else 192
    blocks = gguf_blocks.blocks_from_array(random_blocks(50, k, kind, seed=rows * 3 + kind), kind)
    x = with_outliers(torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)))
    check_against_references(x, blocks, kind, repacked=True, outliers=True)
    check_against_references(x, blocks, kind, repacked=True)            # asked for plain int8: plain int8
    q, d = gguf_blocks.quantize_activations(x)
    plain = (q.double().reshape(rows, -1, 32) * d.double().unsqueeze(-1)).reshape(rows, k)
    fine = gguf_blocks.fine_activations(x)
    assert bool((fine[:, 5] == 40.0).all())                        # the outlier itself, exactly
    error = lambda xq: float((xq - x.double())[:, :32].abs().sum())   # noqa: E731 - the outlier's block
    assert error(fine) < 0.2 * error(plain)


@pytest.mark.parametrize("kind", list(gguf_blocks.KINDS))
def test_repacking_is_undone_byte_for_byte(kind: int) -> None:
    """unpack(repack(b)) is b, for every byte pattern; repack moves bytes, it does not change what they hold."""
    k = 512 if gguf_blocks.KINDS[kind].weights == 256 else 96
    blocks = gguf_blocks.blocks_from_array(random_blocks(37, k, kind, seed=kind, extreme=True), kind)
    repacked = gguf_blocks.repack(blocks, kind)
    assert repacked.shape == blocks.shape and not torch.equal(repacked[:32], blocks[:32])
    assert torch.equal(repacked[32:], blocks[32:])                  # the last 37 % 16 rows as they were
    assert torch.equal(gguf_blocks.unpack(repacked, kind), blocks)


@pytest.mark.parametrize("rows", [3, 20])
@pytest.mark.parametrize("kind", list(gguf_blocks.KINDS))
def test_extreme_scales(rows: int, kind: int) -> None:
    blocks = gguf_blocks.blocks_from_array(random_blocks(40, 768, kind, seed=rows, extreme=True), kind)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 100
    x[0, :32] = 0.0
    x[-1, 64:96] = 1e-30
    check_against_references(x, blocks, kind)


@pytest.mark.parametrize("kind", [gguf_blocks.Q8_0, gguf_blocks.Q5_0, gguf_blocks.Q4_1])
def test_gguf_quantized_weights(kind: int) -> None:
    """Blocks as gguf-py's quantizer writes them from float weights, on an even N."""
    w = np.random.default_rng(3).standard_normal((64, 896)).astype(np.float32) * 0.05
    blocks = gguf_blocks.blocks_from_array(gguf_quantize(w, gguf_blocks.KINDS[kind].qtype), kind)
    for rows in (5, 24):
        x = torch.randn(rows, 896, generator=torch.Generator().manual_seed(4))
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
        ops.gguf_linear(torch.randn(2, 64), blocks, 6, out)
    with pytest.raises(RuntimeError, match=r"kind must be 3 \(Q4_1\), 6 \(Q5_0\), 8 \(Q8_0\), 12 \(Q4_K\), "
                                           r"13 \(Q5_K\) or 14 \(Q6_K\), or one of them \+ 256 \(repacked by "
                                           r"gguf_repack\), got 5"):
        ops.gguf_linear(torch.randn(2, 64), blocks, 5, out)
    with pytest.raises(RuntimeError, match=r"got 261"):
        ops.gguf_linear(torch.randn(2, 64), blocks, 261, out)
    with pytest.raises(RuntimeError, match=r"kind \+ 512 \(outliers kept as floats\) needs repacked blocks .*got 520"):
        ops.gguf_linear(torch.randn(2, 64), blocks, 520, out)
    with pytest.raises(RuntimeError, match=r"gguf_repack: rows of 50 bytes are not whole Q8_0 blocks of 34 bytes"):
        ops.gguf_repack(torch.zeros(4, 50, dtype=torch.uint8), 8, True)
    with pytest.raises(RuntimeError, match=r"out must have shape \(3, 8\)"):
        ops.gguf_linear(torch.randn(3, 64), blocks, 8, out)
    with pytest.raises(RuntimeError, match=r"in_features 640 is not a multiple of 256 \(a K-quant super-block\)"):
        ops.gguf_linear(torch.randn(2, 640), torch.zeros(8, 2 * 144 + 72, dtype=torch.uint8), 12, out)
    k_blocks = gguf_blocks.blocks_from_array(random_blocks(8, 512, 12, seed=0), 12)
    with pytest.raises(RuntimeError, match="do not hold rows of 2 Q6_K blocks of 210 bytes"):
        ops.gguf_linear(torch.randn(2, 512), k_blocks, 14, out)
    with pytest.raises(ValueError, match="kind must be one of 3 .Q4_1., 6 .Q5_0., 8 .Q8_0., 12 .Q4_K., 13 .Q5_K., "
                                         "14 .Q6_K."):
        gguf_blocks.gguf_linear(torch.randn(2, 64), blocks, 5)
    with pytest.raises(ValueError, match=r"in_features 896 is not a multiple of 256 \(Q4_K blocks hold 256"):
        gguf_blocks.gguf_linear(torch.randn(2, 896), k_blocks, GGMLQuantizationType.Q4_K)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avxvnni", "avx2", "portable"])
def test_the_other_instruction_set_paths_agree(isa: str) -> None:
    """The AVX-512 without AMX, AVX-VNNI (256-bit, no AVX-512), AVX2 and portable builds (a separate library
    each) pass the same checks (the GGUF block products, and the LoRA kernel: tests/unit/test_cpu_lora.py)."""
    flags = cpu_ops._cpu_flags()
    if isa != "portable" and not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("this CPU has no AVX2")
    if isa == "avxvnni" and "avx_vnni" not in flags:
        pytest.skip("this CPU has no AVX-VNNI")
    if isa == "avx512" and not {"avx512f", "avx512bw", "avx512vl"} <= flags:
        pytest.skip("this CPU has no AVX-512")
    script = (
        "import torch; from meshkernels import cpu_ops, gguf_blocks; assert cpu_ops.load();"
        "from tests.unit.test_gguf_blocks import random_blocks, check_against_references;"
        "[check_against_references(torch.randn(t, k, generator=torch.Generator().manual_seed(t)),"
        " gguf_blocks.blocks_from_array(random_blocks(37, k, kind, seed=t, extreme=t == 9), kind), kind)"
        " for kind in gguf_blocks.KINDS for k in (96, 512) if k % gguf_blocks.KINDS[kind].weights == 0"
        " for t in (1, 3, 6, 9, 16)];"
        "from tests.unit.test_gguf_blocks import with_outliers;"
        "[check_against_references(with_outliers(torch.randn(t, k, generator=torch.Generator().manual_seed(t))),"
        " gguf_blocks.blocks_from_array(random_blocks(37, k, kind, seed=t, extreme=t == 9), kind), kind, True, o)"
        " for kind in gguf_blocks.KINDS for k in (96, 512) if k % gguf_blocks.KINDS[kind].weights == 0"
        " for t in (1, 3, 6, 9, 16) for o in (False, True)];"
        "from tests.unit.test_gguf_blocks import check_full_scale;"
        "[check_full_scale(kind) for kind in gguf_blocks.KINDS];"
        "from tests.unit.test_cpu_lora import check_against_reference;"
        "[check_against_reference(rows, dtype) for rows in (1, 5, 16) for dtype in (torch.float32, torch.float16)];"
        "print('ok')")
    env = {**os.environ, "INFERMESH_CPU_ISA": isa, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
