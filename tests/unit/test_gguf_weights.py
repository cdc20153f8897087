"""A folder whose weights are a GGUF file (services/engine/runtime/models/gguf_weights.py) and the gguf matmul kind:
names mapped per architecture, quantized tensors kept as blocks, llama's q/k rows and Gemma's norms given
back as transformers gives them, embedding rows de-quantized alone, and products over blocks of mixed
types (q and k in one type, v in another, as real files store them) equal to the float product within
the int8 activations' rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from meshkernels import cpu_ops  # noqa: E402
from services.engine.runtime.models.gguf_weights import Blocks, dense, load  # noqa: E402
from services.engine.runtime.models.linear import (  # noqa: E402
    Concat,
    Fp16WeightLinear,
    GgufLinear,
    GgufRepackedLinear,
    bf16w_runs,
    linear_kind,
)

Q = gguf.GGMLQuantizationType
H, HEADS, KV = 64, 4, 2
D = H // HEADS


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (w, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, w.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {"token_embd.weight": g.normal(0, 0.1, (96, H)), "output_norm.weight": 1 + g.normal(0, 0.1, H),
            "blk.0.attn_norm.weight": 1 + g.normal(0, 0.1, H), "blk.0.attn_q.weight": g.normal(0, 0.1, (H, H)),
            "blk.0.attn_k.weight": g.normal(0, 0.1, (KV * D, H)), "blk.0.attn_v.weight": g.normal(0, 0.1, (KV * D, H)),
            "blk.0.attn_q.bias": g.normal(0, 0.1, H), "blk.0.ffn_down.weight": g.normal(0, 0.1, (H, 2 * H)),
            "blk.0.attn_output.weight": g.normal(0, 0.1, (H, H)), "blk.0.ffn_gate.weight": g.normal(0, 0.1, (2 * H, H)),
            "blk.0.ffn_up.weight": g.normal(0, 0.1, (2 * H, H))}


def _folder(tmp_path: Path, arch: str, types: dict[str, Q], extra: dict[str, np.ndarray] | None = None
            ) -> tuple[Path, dict[str, np.ndarray]]:
    raw = {k: v.astype(np.float32) for k, v in {**_weights(), **(extra or {})}.items()}
    _write(tmp_path / "model.gguf", arch, {k: (v, types.get(k, Q.F32)) for k, v in raw.items()})
    return tmp_path, raw


def _rotary_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for q and k (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_qwen2_names_types_and_blocks(tmp_path: Path) -> None:
    types = {"token_embd.weight": Q.Q5_0, "blk.0.attn_q.weight": Q.Q5_0, "blk.0.attn_k.weight": Q.Q5_0,
             "blk.0.attn_v.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q8_0}
    folder, raw = _folder(tmp_path, "qwen2", types)
    weights = load(folder, 1, HEADS, KV)
    assert set(weights) == {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
                            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                            "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                            "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, Blocks) and q.name == "Q5_0" and q.shape == (H, H) and q.data.dtype == torch.uint8
    assert (dense(q) - torch.from_numpy(raw["blk.0.attn_q.weight"])).abs().max() < 0.03     # Q5_0: 1/32 of the range
    assert isinstance(weights["model.layers.0.self_attn.v_proj.weight"], Blocks)
    assert torch.equal(weights["model.norm.weight"], torch.from_numpy(raw["output_norm.weight"]))
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.bias"], torch.from_numpy(raw["blk.0.attn_q.bias"]))
    embed = weights["model.embed_tokens.weight"]
    assert isinstance(embed, Blocks)
    ids = torch.tensor([[5, 0], [95, 5]])
    assert torch.equal(embed.rows(ids), dense(embed)[ids])


def test_llama_rows_and_gemma_norms_come_back_as_transformers_reads_them(tmp_path: Path) -> None:
    raw = {k: v.astype(np.float32) for k, v in _weights().items()}
    permuted = dict(raw, **{"blk.0.attn_q.weight": _rotary_order(raw["blk.0.attn_q.weight"], HEADS),
                            "blk.0.attn_k.weight": _rotary_order(raw["blk.0.attn_k.weight"], KV)})
    _write(tmp_path / "model.gguf", "llama", {k: (v, Q.Q8_0 if k == "blk.0.attn_q.weight" else Q.F32)
                                              for k, v in permuted.items()})
    weights = load(tmp_path, 1, HEADS, KV)
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(raw["blk.0.attn_k.weight"]))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, Blocks)                         # rows permuted as blocks, not de-quantized
    assert (dense(q) - torch.from_numpy(raw["blk.0.attn_q.weight"])).abs().max() < 2e-3

    gemma = tmp_path / "gemma"
    gemma.mkdir()
    _write(gemma / "model.gguf", "gemma3", {k: (v, Q.F32) for k, v in raw.items()})
    norms = load(gemma, 1, HEADS, KV)
    assert torch.allclose(norms["model.norm.weight"], torch.from_numpy(raw["output_norm.weight"]) - 1)


@pytest.mark.skipif(not cpu_ops.load(), reason="the CPU library (meshkernels/cpu_ops.py) did not build here")
def test_products_over_blocks_of_mixed_types(tmp_path: Path) -> None:
    types = {"blk.0.attn_q.weight": Q.Q5_0, "blk.0.attn_k.weight": Q.Q5_0, "blk.0.attn_v.weight": Q.Q8_0,
             "blk.0.ffn_down.weight": Q.Q4_0}
    folder, _ = _folder(tmp_path, "qwen2", types)
    weights = load(folder, 1, HEADS, KV)
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    parts = [weights[n] for n in names]
    bias = weights["model.layers.0.self_attn.q_proj.bias"]
    assert isinstance(bias, torch.Tensor)
    qkv = Concat(linear_kind("gguf"), parts, [bias, None, None])
    assert len(qkv.parts) == 2                  # q and k (Q5_0) stacked into one product, v (Q8_0) its own
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(0))
    want = x @ torch.cat([dense(p) for p in parts]).T
    want[:, :H] += bias
    got = qkv(x)
    assert got.shape == want.shape and (got - want).abs().max() <= 0.02 * want.abs().max()
    down = GgufLinear(weights["model.layers.0.mlp.down_proj.weight"], None)
    # A type the kernel lacks (Q4_0 here) runs de-quantized, as fp16w.
    assert down.kind is None and isinstance(down.fallback, Fp16WeightLinear)
    # Split kinds: the blocks up to 4 rows, the de-quantized weight above.
    split = linear_kind("gguf", "fp16w", 4)(parts[0], None)
    for rows in (2, 9):
        y = torch.randn(rows, H)
        ref = y @ dense(parts[0]).T
        assert (split(y) - ref).abs().max() <= 0.02 * ref.abs().max()
    # ggufr: the same products by the blocks repacked 16 rows at a time (the file's layout not kept)
    repacked = Concat(linear_kind("ggufr"), parts, [bias, None, None])
    assert all(isinstance(p, GgufRepackedLinear) and p.kind >= 256 for p in repacked.parts)
    assert not any(p.weight.data_ptr() == q.weight.data_ptr() for p, q in zip(repacked.parts, qkv.parts, strict=True))
    assert (repacked(x) - got).abs().max() <= 1e-5 * got.abs().max()
    assert GgufRepackedLinear(weights["model.layers.0.mlp.down_proj.weight"], None).kind is None   # Q4_0: de-quantized


@pytest.mark.skipif(not cpu_ops.load(), reason="the CPU library (meshkernels/cpu_ops.py) did not build here")
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])
def test_a_repacked_embedding_reads_the_files_rows(qtype: Q) -> None:
    """A tied embedding over the head's repacked blocks (RepackedBlocks) gives each row as the file's blocks do,
    rows in whole groups of 16 and in the last rows past them alike."""
    from meshkernels import gguf_blocks
    from services.engine.runtime.models.gguf_weights import RepackedBlocks
    from tests.unit.test_gguf_blocks import random_blocks

    k = 256
    blocks = Blocks(gguf_blocks.blocks_from_array(random_blocks(45, k, int(qtype), seed=1), int(qtype)), qtype, (45, k))
    repacked = RepackedBlocks(gguf_blocks.repack(blocks.data, int(qtype)), qtype, (45, k))
    ids = torch.tensor([[0, 15, 16, 44], [31, 32, 40, 3]])
    assert torch.equal(repacked.rows(ids), blocks.rows(ids))
    assert torch.equal(repacked.dense(), blocks.dense())


@pytest.mark.skipif(not cpu_ops.load(), reason="the CPU library (meshkernels/cpu_ops.py) did not build here")
def test_tuning_times_the_files_own_blocks(tmp_path: Path) -> None:
    import json

    from services.engine.runtime import tune

    # Every tensor the forward reads, and a config they fit: tuning loads the folder as the engine does (its
    # tensors checked against the config first, models/gguf_check.py).
    folder, _ = _folder(tmp_path, "qwen2", {"blk.0.attn_q.weight": Q.Q5_0, "blk.0.attn_k.weight": Q.Q5_0,
                                            "blk.0.attn_v.weight": Q.Q8_0, "blk.0.ffn_gate.weight": Q.Q8_0},
                        {"blk.0.ffn_norm.weight": np.ones(H)})
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "intermediate_size": 2 * H, "num_hidden_layers": 1, "vocab_size": 96, "tie_word_embeddings": True}))
    assert "gguf" in tune.candidates(folder) and "gguf" not in tune.candidates(None)
    layers, gemms = tune.shapes(folder)
    assert "ggufr" in tune.candidates(folder) and "ggufr" not in tune.candidates(None)
    table = tune.measure(layers, gemms, ["gguf", "ggufr"], reps=1, folder=folder)
    for kind in ("gguf", "ggufr"):
        assert len(table[kind]) == len(tune.ROWS) and all(ms > 0 for ms in table[kind])
    timed = load(folder, 1, HEADS, KV)
    assert sorted({w.name for w in timed.values() if isinstance(w, Blocks)}) == ["Q5_0", "Q8_0"]


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q5_0])
def test_dequantizing_equals_gguf_py_bit_for_bit(qtype: Q) -> None:
    """Q4_1 and Q8_0 are de-quantized by torch's ops (quant.dequantize), every other type by gguf-py: the same
    float32 weights either way."""
    w = np.random.default_rng(1).normal(0, 0.1, (24, 96)).astype(np.float32)
    data = gguf.quants.quantize(w, qtype)
    blocks = Blocks(torch.from_numpy(data.copy()), qtype, (24, 96))
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(24, 96))
    assert torch.equal(blocks.dense(), want)
    assert torch.equal(blocks.rows(torch.tensor([[3, 0], [23, 3]])), want[torch.tensor([[3, 0], [23, 3]])])


@pytest.mark.skipif(not cpu_ops.load(), reason="the CPU library (meshkernels/cpu_ops.py) did not build here")
def test_q4_and_q8_kinds_take_a_files_blocks_of_their_layout_as_they_are(tmp_path: Path) -> None:
    """A Q4_1 weight is q4's blocks and a Q8_0 weight q8's, byte for byte: the kinds multiply by the file's own
    bytes (nothing de-quantized and packed again); a Q8_0 weight under q4 is q8's; any other type is
    de-quantized, then packed where that is lossless (not for Q5_0's 5-bit weights) or run by the fallback."""
    from services.engine.runtime.models.linear import Q4Linear, Q8LayerLinear, Q8Linear

    types = {"blk.0.attn_q.weight": Q.Q4_1, "blk.0.attn_k.weight": Q.Q8_0, "blk.0.attn_v.weight": Q.Q5_0}
    folder, _ = _folder(tmp_path, "qwen2", types)
    weights = load(folder, 1, HEADS, KV)
    q, k, v = (weights[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert isinstance(q, Blocks) and isinstance(k, Blocks) and isinstance(v, Blocks)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    q4 = Q4Linear(q, None)
    assert q4.lossless and q4.weight.data_ptr() == q.data.data_ptr()
    q4_of_q8 = Q4Linear(k, None)
    assert isinstance(q4_of_q8.fallback, Q8LayerLinear) and q4_of_q8.fallback.weight.data_ptr() == k.data.data_ptr()
    head = Q8Linear(k, None)
    assert head.lossless and head.weight.data_ptr() == k.data.data_ptr()
    q4_of_q5 = Q4Linear(v, None)
    assert not q4_of_q5.lossless
    for layer, weight in ((q4, q), (q4_of_q8, k), (head, k), (q4_of_q5, v)):
        torch.testing.assert_close(layer(x), x @ dense(weight).T, rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not cpu_ops.load(), reason="the CPU library (meshkernels/cpu_ops.py) did not build here")
@pytest.mark.skipif(not bf16w_runs(), reason="oneDNN's bf16 weights need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT")
def test_a_split_plans_head_splits_as_its_layers(tmp_path: Path) -> None:
    """q4 up to 4 rows, bf16w above: the head is the file's 8-bit blocks up to 4 rows (its exact product) and
    bf16w's above; a plan of one kind, or whose large kind's head would be an fp32 copy, keeps one head."""
    from services.engine.runtime.models.linear import Bf16WeightLinear, Q8Linear, SplitLinear, head_kind

    folder, _ = _folder(tmp_path, "qwen2", {"blk.0.attn_k.weight": Q.Q8_0})
    k = load(folder, 1, HEADS, KV)["model.layers.0.self_attn.k_proj.weight"]
    head = head_kind("q4", "bf16w", 4)(k, None)
    assert isinstance(head, SplitLinear) and isinstance(head.small, Q8Linear) and head.small.lossless
    assert isinstance(head.large, Bf16WeightLinear) and head.rows == 4
    for rows, kind in ((4, head.small), (5, head.large)):
        x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(head(x), kind(x), rtol=0, atol=0)
    torch.testing.assert_close(head(x), x @ dense(k).T, rtol=2e-2, atol=2e-2)      # bf16's rounding above 4 rows
    assert isinstance(head_kind("q4")(k, None), Q8Linear)
    assert isinstance(head_kind("q4", "fp16w", 4)(k, None), Q8Linear)     # an fp32 head above: not taken
    assert isinstance(head_kind("bf16w")(k, None), Bf16WeightLinear)
