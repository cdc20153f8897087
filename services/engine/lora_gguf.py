"""GGUF LoRA files as llama.cpp's `convert_lora_to_gguf.py` writes them, read with gguf-py for lora.py's `build`.

Such a file has `general.type` "adapter", `adapter.type` "lora" and `adapter.lora.alpha`; each adapted projection
is two tensors, `blk.N.{attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down}.weight.lora_a` (PEFT's lora_A,
rank x in) and `.lora_b` (lora_B, out x rank), in F32, F16, BF16 or Q8_0.  The converter runs the base model's own
tensor changes on the pair, so for the `llama` architecture lora_b's q and k rows are in llama.cpp's rotary order:
put back here as services/engine/models/gguf_weights.py puts the base weights back.  The scale is llama.cpp's:
alpha / rank, the rank each pair's own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.lora import Adapter, Shape, build, weights_key
from services.engine.models.gguf_weights import unpermute

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


def read_gguf_lora(file: Path, shape: Shape) -> tuple[dict[str, Any], dict[tuple[int, str], dict[str, torch.Tensor]]]:
    """(config, {(layer, module): {"A": (r, in), "B": (out, r)}}) of a GGUF LoRA file; ValueError naming what is
    wrong with it."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(file))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{file}: not a GGUF file gguf-py can read ({exc})") from None
    kind, lora, alpha = (_field(reader, k) for k in ("general.type", "adapter.type", "adapter.lora.alpha"))
    if kind != "adapter" or lora != "lora":
        raise ValueError(f"{file}: general.type {kind!r} / adapter.type {lora!r}: not a LoRA adapter (llama.cpp's "
                         "convert_lora_to_gguf.py writes 'adapter' / 'lora')")
    permuted = _field(reader, "general.architecture") in _PERMUTED
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        match = _NAME.match(tensor.name)
        if match is None or match.group(2) not in MODULES:
            raise ValueError(f"{file}: tensor {tensor.name!r} is not a LoRA factor of {', '.join(MODULES)}")
        layer, module, which = int(match.group(1)), MODULES[match.group(2)], match.group(3).upper()
        if layer >= shape.layers:
            raise ValueError(f"{file}: layer {layer} is past the model's {shape.layers} layers")
        value = torch.from_numpy(_floats(tensor, gguf))
        if which == "B" and permuted and module in ("q_proj", "k_proj") and shape.heads:
            heads = shape.heads if module == "q_proj" else shape.kv_heads or shape.heads
            value = unpermute(value, heads)            # type: ignore[assignment]   # a tensor in, a tensor out
        pairs.setdefault((layer, module), {})[which] = value
    # One alpha for the file: lora.py scales each pair by it over the pair's own rank, as llama.cpp does (no
    # alpha: a scale of 1, which lora.py gives when lora_alpha is absent).
    config: dict[str, Any] = {"r": max((ab["A"].shape[0] for ab in pairs.values() if "A" in ab), default=0)}
    if alpha:
        config["lora_alpha"] = float(alpha)
    return config, pairs


def _floats(tensor: Any, gguf: Any) -> np.ndarray:
    """A tensor as float32 (rows, columns), in memory of its own: F32 and F16 as stored, others by gguf-py's
    dequantization."""
    T = gguf.GGMLQuantizationType
    shape = tuple(int(n) for n in reversed(tensor.shape))          # ggml lists the row length first
    if tensor.tensor_type in (T.F32, T.F16):
        return np.array(tensor.data, dtype=np.float32).reshape(shape)      # a copy: the file's map is read-only
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def _field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()

