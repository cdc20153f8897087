"""Issue 49's advisory list: LoRA paths outside the folders an operator allowed.  An admin key's
`POST /v1/load_lora_adapter {"lora_path": ...}` could name any folder of an engine's machine; with
`--lora-roots DIR[,DIR]` (INFERMESH_ENGINE_LORA_ROOTS) an engine loads adapters from under those folders only,
symlinks and `..` resolved (services/engine/rpcs/adapters.py: confined)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mesh.errors import InvalidArgument
from services.engine.__main__ import parse
from services.engine.rpcs.adapters import confined


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    allowed, outside = tmp_path / "adapters", tmp_path / "adapters-evil"
    (allowed / "a").mkdir(parents=True)
    outside.mkdir()
    (allowed / "escape").symlink_to(outside)
    return allowed, outside


def test_a_path_under_a_root_loads(roots: tuple[Path, Path]) -> None:
    allowed, _ = roots
    confined(str(allowed / "a"), (str(allowed),))
    confined(str(allowed), (str(allowed) + os.sep,))
    confined("/anything/at/all", ())                         # no roots configured: anywhere


@pytest.mark.parametrize("path", ["{outside}", "{allowed}/../adapters-evil", "{allowed}/escape", "/etc",
                                  "{allowed}-evil/a"])
def test_a_path_outside_every_root_is_refused(roots: tuple[Path, Path], path: str) -> None:
    allowed, outside = roots
    path = path.format(allowed=allowed, outside=outside)
    with pytest.raises(InvalidArgument, match="outside the folders this engine loads adapters from"):
        confined(path, (str(allowed),))


def test_the_flag_and_its_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    assert parse(["--model", f"m={tmp_path}"]).lora_roots == ()
    assert parse(["--model", f"m={tmp_path}", "--lora-roots", "/srv/a,/srv/b"]).lora_roots == ("/srv/a", "/srv/b")
    monkeypatch.setenv("INFERMESH_ENGINE_LORA_ROOTS", "/srv/c")
    assert parse(["--model", f"m={tmp_path}"]).lora_roots == ("/srv/c",)
