"""Shared fixtures: the default model's folder (pulled by `make setup`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh import models


@pytest.fixture(scope="session")
def model_dir() -> Path:
    try:
        return models.path("default")
    except models.ModelError as exc:
        pytest.fail(f"{exc} (run `make setup`)")
