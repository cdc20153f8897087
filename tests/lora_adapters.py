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
