"""`infermesh up` for the benches that drive a whole mesh over HTTP (bench/batch_api.py, bench/fair_scheduling.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infermesh.launcher import http_ok  # noqa: E402


@contextmanager
def infermesh_up(offset: int, log: Path, env: dict[str, str] | None = None, engines: int = 1) -> Iterator[str]:
    """`infermesh up --engines N --port-offset OFFSET` (its cache folder beside `log`, which takes its output)
    until the block ends: the edge's URL once /health answers (SystemExit with the log's end if it never does)."""
    http = f"http://127.0.0.1:{8000 + offset}"
    argv = [sys.executable, "-m", "infermesh.cli", "up", "--engines", str(engines), "--port-offset", str(offset),
            "--cache-dir", str(log.parent / "cache")]
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 300
        while not http_ok(f"{http}/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"infermesh up did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield http
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
