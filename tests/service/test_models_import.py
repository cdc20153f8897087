"""`import mesh.models` stays standard-library only (the CLI starts fast): checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_import_is_stdlib_only():
    code = ("import sys, mesh.models\n"
            "print(sorted(m for m in ('torch', 'transformers', 'gguf', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"
