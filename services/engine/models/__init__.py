"""Model architectures by Hugging Face `model_type`: a dict registry."""

from __future__ import annotations

from services.engine.models.llama import LlamaConfig, LlamaModel

ARCHITECTURES = {"llama": (LlamaConfig, LlamaModel), "mistral": (LlamaConfig, LlamaModel),
                 "qwen2": (LlamaConfig, LlamaModel)}
