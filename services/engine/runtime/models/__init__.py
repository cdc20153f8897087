"""Model architectures by Hugging Face `model_type`: a dict registry."""

from __future__ import annotations

from mesh.models import SUPPORTED_MODEL_TYPES
from services.engine.runtime.models.config import LlamaConfig
from services.engine.runtime.models.llama import LlamaModel

# The supported types are listed once, in mesh/models/catalog.py (the CLI checks folders against it
# without importing torch); each is run by the Llama-family forward.
ARCHITECTURES = {model_type: (LlamaConfig, LlamaModel) for model_type in SUPPORTED_MODEL_TYPES}
