"""PEFT LoRA adapters for the tests (tests/service/test_lora.py, tests/e2e/test_lora.py): built on a transformers
model with nonzero B matrices, saved as PEFT writes them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(base: Any, folder: Path, seed: int, rank: int, targets: list[str]) -> Any:
    """A PEFT LoRA adapter of `base` with small random A and B (PEFT's default leaves B zero: no effect).
    peft is imported here, not with the module: it imports triton, which must first see tests/unit/
    test_triton_ops.py's TRITON_INTERPRET when both run in one process."""
    peft = pytest.importorskip("peft", reason="peft builds the reference adapters (pip install peft)")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.05)
    model.save_pretrained(str(folder))
    return model.eval()


LLAMA_CPP_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                   "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def write_gguf_lora(folder: Path, out: Path, heads: int, kv_heads: int, half: bool = False) -> Path:
    """A PEFT folder as llama.cpp's convert_lora_to_gguf.py lays it out for a `llama` base: general.type adapter,
    adapter.type lora, adapter.lora.alpha; `blk.N.<tensor>.weight.lora_a` / `.lora_b`; lora_b's q and k rows
    in llama.cpp's rotary order (each head's two halves interleaved); F32 or F16."""
    import json
    import re

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    for key, value in sorted(load_file(str(folder / "adapter_model.safetensors")).items()):
        m = re.search(r"layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight$", key)
        assert m is not None, key
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        array = value.float().numpy()
        if which == "B" and module in ("q_proj", "k_proj"):
            n = heads if module == "q_proj" else kv_heads
            rows = array.shape[0]
            array = array.reshape(n, 2, rows // n // 2, array.shape[1]).swapaxes(1, 2).reshape(array.shape)
        array = np.ascontiguousarray(array, dtype=np.float16 if half else np.float32)
        writer.add_tensor(f"blk.{layer}.{LLAMA_CPP_NAMES[module]}.weight.lora_{which.lower()}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def random_adapter(base_config: Any, folder: Path, seed: int, rank: int) -> Path:
    """A PEFT folder of random factors on every projection, written directly (no peft model built): for tests
    that need an adapter's size, not a reference answer."""
    import json

    from safetensors.torch import save_file

    c = base_config
    head_dim = c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    dims = {"self_attn.q_proj": (c.hidden_size, q), "self_attn.k_proj": (c.hidden_size, kv),
            "self_attn.v_proj": (c.hidden_size, kv), "self_attn.o_proj": (q, c.hidden_size),
            "mlp.gate_proj": (c.hidden_size, c.intermediate_size), "mlp.up_proj": (c.hidden_size, c.intermediate_size),
            "mlp.down_proj": (c.intermediate_size, c.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_hidden_layers):
        for module, (fan_in, fan_out) in dims.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": TARGETS}))
    return folder
