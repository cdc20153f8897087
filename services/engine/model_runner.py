"""Owns the weights and each request's KV state; turns token ids into next-token logits.

This first runner drives the Hugging Face Llama-family forward with one KV cache per
request, which reproduces transformers' greedy output bit for bit in float32.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mesh import model_store


class ModelRunner:
    def __init__(self, folder: str | Path, dtype: str = "float32", device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.folder = Path(folder)
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        model: Any = AutoModelForCausalLM.from_pretrained(str(self.folder), dtype=self.dtype)
        self.model: Any = model.to(self.device).eval()
        config = json.loads((self.folder / "config.json").read_text())
        self.max_context = int(config.get("max_position_embeddings", 2048))
        self.vocab_size = int(config["vocab_size"])
        self.eos_token_ids = model_store.eos_token_ids(self.folder)
        # transformers 5 renamed `past_key_values` to `cache`; accept either generation.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """Logits (V,) float32 after the whole prompt, and the new KV state."""
        from transformers import DynamicCache

        cache = DynamicCache()
        input_ids = torch.tensor([list(ids)], device=self.device)  # (1, T)
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
        return out.logits[0, -1].float().cpu(), cache

    @torch.inference_mode()
    def decode(self, token_id: int, kv: Any) -> tuple[torch.Tensor, Any]:
        """Logits (V,) float32 after one more token, extending `kv` in place."""
        input_ids = torch.tensor([[token_id]], device=self.device)  # (1, 1)
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self._cache_arg: kv})
        return out.logits[0, -1].float().cpu(), kv
