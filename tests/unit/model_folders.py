"""Helpers for the mesh.models tests: a throwaway $INFERMESH_HOME and fake Hugging Face folders."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mesh.models import DEFAULT_MODEL, ModelSpec


@pytest.fixture
def store_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("INFERMESH_HOME", str(home))
    return home


def hf_folder(root: Path, model_type: str = "llama", tokenizer: tuple[str, ...] = ("tokenizer.json",)) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    for name in tokenizer:
        (root / name).write_text("{}")
    return root


def fake_spec(payload: bytes, name: str = DEFAULT_MODEL) -> ModelSpec:
    return ModelSpec(name=name, package="llm-fake", version="9.9", member="fake/model.gguf",
                     sha256=hashlib.sha256(payload).hexdigest(), description="fake")
