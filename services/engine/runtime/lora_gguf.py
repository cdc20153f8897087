"""GGUF LoRA files as llama.cpp's `convert_lora_to_gguf.py` writes them, read for lora.py's `build` by
mesh/models/gguf_header.py's reader (every count, length and tensor bounded by the file: a short or malformed file
is refused by name) and de-quantized by gguf-py.

Such a file has `general.type` "adapter", `adapter.type` "lora" and `adapter.lora.alpha`; each adapted projection
is two tensors, `blk.N.{attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down}.weight.lora_a` (PEFT's lora_A,
rank x in) and `.lora_b` (lora_B, out x rank), in F32, F16, BF16 or Q8_0.  The converter runs the base model's own
tensor changes on the pair, so for the `llama` architecture lora_b's q and k rows are in llama.cpp's rotary order:
put back here as services/engine/runtime/models/gguf_weights.py puts the base weights back.  The scale is llama.cpp's:
alpha / rank, the rank each pair's own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.runtime.lora import Adapter, Pairs, Shape, add_factor, build, weights_key
from services.engine.runtime.lora_checks import positive, shown
from services.engine.runtime.models.gguf_weights import unpermute

MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
           "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
_PERMUTED = ("llama",)            # architectures whose converter permutes q/k rows (as gguf_weights.py's)


def load_gguf_adapter(name: str, file: Path, shape: Shape, dtype: torch.dtype = torch.float32) -> Adapter:
    """A GGUF LoRA file as an Adapter for a model of `shape` (lora.py's load_adapter for PEFT folders)."""
    config, pairs = read_gguf_lora(file, shape)
    return build(name, weights_key(name, file), config, pairs, shape, dtype, file)


def is_gguf_lora(path: Path) -> Path | None:
    """The GGUF file `path` names: itself, or the one .gguf of a folder without adapter_config.json; else None."""
    if path.suffix == ".gguf" and path.is_file():
        return path
    if path.is_dir() and not (path / "adapter_config.json").is_file():
        found = list(path.glob("*.gguf"))
        return found[0] if len(found) == 1 else None
    return None


def read_gguf_lora(file: Path, shape: Shape) -> tuple[dict[str, Any], Pairs]:
    """(config, {(layer, module): {"A": (name, (r, in)), "B": (name, (out, r))}}) of a GGUF LoRA file; ValueError
    naming what is wrong with it.  The header is mesh/models/gguf_header.py's reader, which refuses a file too short
    for its header, counts or tensors the file cannot hold, before any tensor is read."""
    import gguf

    from mesh.models.gguf_header import read_header, tensor_data

    header = read_header(file)                          # GgufError (a ValueError) naming the file and the fault
    kind, lora, alpha = (header.metadata.get(k) for k in ("general.type", "adapter.type", "adapter.lora.alpha"))
    if kind != "adapter" or lora != "lora":
        raise ValueError(f"{file}: general.type {shown(kind)} / adapter.type {shown(lora)}: not a LoRA adapter "
                         "(llama.cpp's convert_lora_to_gguf.py writes 'adapter' / 'lora')")
    if alpha is not None and not (alpha == 0 or positive(alpha)):
        raise ValueError(f"{file}: adapter.lora.alpha {shown(alpha)} is not a finite positive number (or 0: none)")
    permuted = header.metadata.get("general.architecture") in _PERMUTED
    mapped = np.memmap(file, np.uint8, "c")
    pairs: Pairs = {}
    for tensor in header.tensors:
        match = _NAME.match(tensor.name)
        if match is None or match.group(2) not in MODULES:
            raise ValueError(f"{file}: tensor {shown(tensor.name)} is not a LoRA factor of {', '.join(MODULES)}")
        layer, module, which = int(match.group(1)), MODULES[match.group(2)], match.group(3).upper()
        if layer >= shape.layers:
            raise ValueError(f"{file}: layer {layer} is past the model's {shape.layers} layers")
        if len(tensor.dims) != 2:
            raise ValueError(f"{file}: tensor {tensor.name!r} has dims {list(tensor.dims)}; a LoRA factor is a matrix")
        value = torch.from_numpy(_floats(tensor_data(mapped, tensor), tensor.shape, gguf.GGMLQuantizationType(
            tensor.qtype), gguf, file, tensor.name))
        if which == "B" and permuted and module in ("q_proj", "k_proj") and shape.heads:
            heads = shape.heads if module == "q_proj" else shape.kv_heads or shape.heads
            if value.shape[0] % (2 * heads) == 0:       # else the shape check (lora.py's build) names it
                value = unpermute(value, heads)        # type: ignore[assignment]   # a tensor in, a tensor out
        add_factor(pairs, file, (layer, module, which), tensor.name, value)
    del mapped
    # One alpha for the file: lora.py scales each pair by it over the pair's own rank, as llama.cpp does (no
    # alpha, or 0: a scale of 1, which lora.py gives when lora_alpha is absent).
    config: dict[str, Any] = {"r": max((ab["A"][1].shape[0] for ab in pairs.values() if "A" in ab), default=0)}
    if alpha:
        config["lora_alpha"] = float(alpha)
    return config, pairs


def _floats(data: np.ndarray, shape: tuple[int, ...], qtype: Any, gguf: Any, file: Path, name: str) -> np.ndarray:
    """A tensor as float32 (rows, columns), in memory of its own: F32 and F16 as stored, others by gguf-py's
    dequantization (a type it has none for refused by name)."""
    T = gguf.GGMLQuantizationType
    if qtype in (T.F32, T.F16):
        return np.array(data, dtype=np.float32).reshape(shape)      # a copy: the file's map is not kept
    try:
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(shape)
    except NotImplementedError:
        raise ValueError(f"{file}: tensor {name!r} is of type {qtype.name}, which gguf-py cannot de-quantize") from None
