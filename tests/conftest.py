"""Shared fixtures: the default model's folder (pulled by `make setup`)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from mesh import model_store

    try:
        return model_store.path("default")
    except model_store.ModelError as exc:
        pytest.fail(f"{exc} (run `make setup`)")
