"""bench/gpu_check.py --smoke: the GPU check's own code (parity, bf16 logits, the Triton kernel through its
interpreter, decode graphs without capture, the throughput table) on a tiny model on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_passes_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    names = {c["check"]: c["pass"] for c in results["checks"]}
    assert names == {"Triton paged decode kernel": True, "tiny fp32 greedy parity": True, "tiny bf16 logits": True}
    assert [e["concurrent"] for e in results["throughput"]] == [1, 4]
    assert "| tiny | 4 |" in proc.stdout
