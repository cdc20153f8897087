"""End to end, issue 20: `infermesh up` restarts a service that dies (kill -9), reports it in its log and
its metric, and the mesh serves again."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import openai
import pytest

from tests.e2e.conftest import OFFSET, Mesh

pytestmark = pytest.mark.e2e


def tokenizer_pid() -> int | None:
    pattern = f"services.tokenizer --replica-id tokenizer-0 --port {50052 + OFFSET}"
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def test_a_killed_tokenizer_is_restarted_and_the_mesh_serves_again(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{mesh.http}/v1", api_key="unused", max_retries=0, timeout=60)
    ask = [{"role": "user", "content": "Hi"}]
    client.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=2)
    before = tokenizer_pid()
    assert before is not None
    os.kill(before, signal.SIGKILL)
    deadline = time.monotonic() + 90
    answered = None
    while time.monotonic() < deadline:
        try:
            answered = client.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=2)
            if tokenizer_pid() not in (None, before):
                break
        except openai.APIError:
            pass                              # 503 while the tokenizer is away: a retryable answer
        time.sleep(0.5)
    after = tokenizer_pid()
    assert answered is not None and after not in (None, before)
    log = mesh.log.read_text()
    assert "infermesh: tokenizer-0 exited with code -9; restarting it in" in log
    assert "infermesh: tokenizer-0 restarted (restart 1)" in log
    with urllib.request.urlopen(f"http://127.0.0.1:{9183 + OFFSET}/metrics", timeout=5) as reply:
        metrics = reply.read().decode()
    assert 'infermesh_launcher_restarts_total{service="tokenizer"} 1.0' in metrics
