"""`infermesh up --draft-model`: real processes, the openai client.  The engine drafts with a second model in
its process (here the default model drafting for itself: the same tokenizer), greedy answers stay
transformers' own (float32), sampled streams finish, and the engine's metrics count the drafts and their
measured speed-up.  A draft model that is not there is refused by `up` before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import OFFSET, Mesh, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 3000
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def drafting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("draft") / "infermesh-up.log"
    with running_mesh(["--engines", "1", "--dtype", "float32", "--draft-model", "default", "--insecure-mesh"],
                      PORTS, log) as mesh:
        yield mesh


def metric(mesh: Mesh, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{mesh.engine_metrics_port}/metrics", timeout=10).text
    found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not exported"
    return float(found.group(1))


def test_greedy_answers_are_the_models_own_and_drafts_are_counted(drafting: Mesh, reference) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{drafting.http}/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Name three rivers of Europe and say where each one flows."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    assert reply.choices[0].message.content == reference(40, messages=messages)
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.8, top_p=0.95,
                                            max_tokens=40, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
    assert metric(drafting, "infermesh_engine_draft_tokens_total") > 0
    assert metric(drafting, "infermesh_engine_draft_speedup") > 0      # measured against plain steps


def test_a_draft_model_that_is_not_there_is_refused_at_once(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "infermesh.cli", "up", "--draft-model", "no-such-model"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no-such-model" in done.stderr, done.stderr
