"""Every repository path a docstring or a Markdown page names exists: a file moved or renamed cannot leave
a pointer to nowhere behind (docstrings under the packages, bench/ and tests/; README.md, docs/, the
deploy and bench READMEs).  A path counts when it starts at a top-level folder (`services/edge/app.py`,
`docs/operations.md`, `meshkernels/`)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("infermesh", "mesh", "services", "meshkernels", "bench", "tests", "docs", "compose", "proto", ".ci")
FOLDERS = "|".join(re.escape(t) for t in TOP)
PATH = re.compile(rf"(?<![\w./~-])((?:{FOLDERS})/[\w./-]*[\w/])")
# Paths the docs tell a person to create (not in the repository until then).
CREATED = {"compose/mesh-ca"}


def docstrings(file: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield text


def named(text: str) -> set[str]:
    return {m.rstrip(".") for m in PATH.findall(text)} - CREATED


def test_paths_named_in_docstrings_exist() -> None:
    missing = sorted(f"{file.relative_to(ROOT)}: {path}"
                     for top in ("infermesh", "mesh", "services", "meshkernels", "bench", "tests")
                     for file in (ROOT / top).rglob("*.py")
                     for text in docstrings(file) for path in named(text) if not (ROOT / path).exists())
    assert not missing, "docstrings name paths that do not exist:\n" + "\n".join(missing)


def test_paths_named_in_the_docs_exist() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "compose" / "README.md",
             ROOT / "bench" / "README.md"]
    missing = sorted(f"{page.relative_to(ROOT)}: {path}" for page in pages for path in named(page.read_text())
                     if not (ROOT / path).exists())
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_path() -> None:
    assert named("see services/edge/nowhere.py and `docs/operations.md`.") == {"services/edge/nowhere.py",
                                                                                "docs/operations.md"}
    assert named("a/mesh/cli.py ~/mesh/x.py") == set()             # not from the repository's root
