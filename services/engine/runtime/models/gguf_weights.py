"""A model folder whose weights are a GGUF file (`model.gguf`, as `infermesh model register` keeps it): the
tensors by their Hugging Face names, the quantized ones as the file stores them.

`load(folder, config)` reads the file's header (mesh/models/gguf_header.py), maps the file, copies each tensor into
torch's memory (2 MB pages in the engine, see _tensor; the mapping is gone when load returns), and returns a dict of
Hugging Face name -> float32 tensor (norms, biases, F32/F16 weights) or `Blocks` (a quantized weight, not
de-quantized: the `gguf` matmul kind multiplies by its blocks; every other kind asks for `dense()`).

The names and row orders are llama.cpp's converter's, undone as transformers' GGUF loader undoes them
(so `--dtype float32` computes what transformers computes from `gguf_file=`): gguf-py's tensor-name map
per architecture, q/k rows of the `llama` architecture back from llama.cpp's rotary order (a row
permutation, so blocks permute as rows), and Gemma's norms stored as 1 + w given back as w.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshkernels import quant

FILE = "model.gguf"

# The Hugging Face names the forward reads (per layer under model.layers.N.), without .weight / .bias.
_TOP = ("model.embed_tokens", "model.norm", "lm_head")
_LAYER = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
          "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.qkv_proj",
          "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
          "mlp.gate_up_proj")
# general.architecture values whose converter permutes q/k rows, and those that store norms as 1 + w.
_PERMUTED = ("llama",)
_NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3")


@dataclass(frozen=True)
class Blocks:
    """A weight as the GGUF file stores it: `data` (N, row bytes) uint8, N rows of quantized blocks along
    the K inputs.  `qtype`: its gguf.GGMLQuantizationType."""

    data: torch.Tensor
    qtype: Any
    shape: tuple[int, int]          # (N, K): out_features, in_features

    @property
    def name(self) -> str:
        return str(self.qtype.name)

    def dense(self) -> torch.Tensor:
        """The float32 (N, K) weight, by gguf-py's dequantization (transformers' too)."""
        return _dequantize(self.data.numpy(), self.qtype, self.shape[1])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows `ids` (an embedding lookup), de-quantized alone."""
        return _dequantize(self.data[ids.flatten()].numpy(), self.qtype, self.shape[1]).reshape(
            *ids.shape, self.shape[1])

    def permute_rows(self, order: torch.Tensor) -> Blocks:
        return Blocks(self.data[order].contiguous(), self.qtype, self.shape)

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        """Rows of several weights of one type and width, stacked (q/k/v or gate/up as one product)."""
        if len({(p.qtype, p.shape[1]) for p in parts}) != 1:
            raise ValueError("only blocks of one type and width stack")
        return Blocks(torch.cat([p.data for p in parts]), parts[0].qtype, (sum(p.shape[0] for p in parts),
                                                                            parts[0].shape[1]))


@dataclass(frozen=True)
class RepackedBlocks(Blocks):
    """A weight's blocks after gguf_blocks.repack (16 rows at a time): a tied embedding reading the head's
    repacked copy, so the file's layout is not kept beside it.  Rows come back through unpack, a group at a
    time."""

    def dense(self) -> torch.Tensor:
        from meshkernels.gguf_blocks import unpack

        return _dequantize(unpack(self.data, int(self.qtype)).numpy(), self.qtype, self.shape[1])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        from meshkernels.gguf_blocks import GROUP, unpack

        flat = ids.flatten()
        raw = self.data[flat]                             # right as they are for the last rows, past whole groups
        grouped = flat < self.shape[0] // GROUP * GROUP
        if bool(grouped.any()):
            # each id's whole group, side by side, un-repacked in one call; then the id's row of its group
            groups = torch.div(flat[grouped], GROUP, rounding_mode="floor")
            file = unpack(self.data[(groups[:, None] * GROUP + torch.arange(GROUP)).flatten()], int(self.qtype))
            raw[grouped] = file.view(-1, GROUP, file.shape[1])[torch.arange(len(groups)), flat[grouped] % GROUP]
        return _dequantize(raw.numpy(), self.qtype, self.shape[1]).reshape(*ids.shape, self.shape[1])


Weight = torch.Tensor | Blocks


def dense(weight: Weight) -> torch.Tensor:
    """A weight as a float tensor (Blocks de-quantized)."""
    return weight.dense() if isinstance(weight, Blocks) else weight


def has_gguf(folder: Path) -> bool:
    return (Path(folder) / FILE).is_file()


def _dequantize(data: np.ndarray[Any, Any], qtype: Any, k: int) -> torch.Tensor:
    """gguf-py's float32 weights.  Q4_1 and Q8_0 (the default model's types) by torch's vector ops, which
    compute the same float32 d * q + m (d * q) bit for bit (tests/unit/test_gguf_weights.py), ~4x faster."""
    from gguf.quants import dequantize

    packed = quant.from_gguf(torch.from_numpy(data), qtype.name, k)
    if packed is not None:
        return quant.dequantize(packed)

    out = np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32)
    return torch.from_numpy(out.reshape(-1, k))


def _tensor(array: np.ndarray[Any, Any]) -> torch.Tensor:
    """A mapped array copied into torch's own memory.  Every step streams the blocks: in the allocator's
    2 MB pages (the engine sets THP_MEM_ALLOC_ENABLE) a GEMV reads them 1.3x faster than through the
    file's 4 KB pages, and once nothing is a view of the mapping the file's pages leave the process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)       # a read-only view, copied at once
        return torch.from_numpy(array).clone()


def hf_names(arch_name: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name of each tensor the forward may read, by gguf-py's tensor-name map of
    the file's architecture (the first Hugging Face name wins where two map to one tensor)."""
    import gguf

    from mesh.models.gguf_header import GgufError

    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name), None)
    if arch is None:
        raise GgufError(f"{FILE}: gguf-py does not know the architecture {arch_name!r}")
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    names: dict[str, str] = {}
    for base in (*_TOP, *(f"model.layers.{i}.{part}" for i in range(num_layers) for part in _LAYER)):
        found = name_map.get_name(base)
        if found is not None:
            names.setdefault(found + ".weight", base + ".weight")
            names.setdefault(found + ".bias", base + ".bias")
    return names


def load(folder: Path, num_layers: int, num_heads: int, num_kv_heads: int) -> dict[str, Weight]:
    """The weights of `folder`/model.gguf by Hugging Face name (see the module's docstring).  Their shapes and types
    are not checked here: the engine's load_weights (models/config.py) runs models/gguf_check.py first."""
    import gguf

    from mesh.models.gguf_header import read_header, tensor_data

    header = read_header(Path(folder) / FILE)
    arch_name = header.string("general.architecture")
    names = hf_names(arch_name, num_layers)
    mapped = np.memmap(header.path, np.uint8, "c")
    weights: dict[str, Weight] = {}
    for t in header.tensors:
        name = names.get(t.name)
        if name is None:
            continue                          # e.g. rope_freqs: derived from the config, as transformers does
        qtype = gguf.GGMLQuantizationType(t.qtype)
        data = tensor_data(mapped, t)
        weight: Weight
        if qtype.name in ("F32", "F16", "BF16"):
            weight = _float_tensor(data, qtype, t.dims[0]).reshape(t.shape)
            if arch_name in _NORM_PLUS_ONE and name.endswith("norm.weight"):
                weight = weight - 1
        else:
            weight = Blocks(_tensor(data.reshape(t.shape[0] if len(t.shape) == 2 else 1, -1)), qtype,
                            (t.shape[0], t.shape[-1]))
        if arch_name in _PERMUTED and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            weight = unpermute(weight, heads)
        weights[name] = weight
    del mapped
    return weights


def _float_tensor(data: np.ndarray[Any, Any], qtype: Any, width: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType as T

    if qtype == T.F32:
        return _tensor(np.asarray(data))
    if qtype == T.F16:
        return torch.from_numpy(np.asarray(data, dtype=np.float32))     # the widening is the copy
    return _dequantize(np.asarray(data), qtype, width).flatten()       # BF16


def unpermute(weight: Weight, heads: int) -> Weight:
    """Rows back from llama.cpp's rotary order (each head's halves interleaved) to transformers'."""
    rows = weight.shape[0]
    half = rows // heads // 2
    order = torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)
    return weight.permute_rows(order) if isinstance(weight, Blocks) else weight[order].contiguous()
