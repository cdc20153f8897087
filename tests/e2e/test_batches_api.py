"""End to end, issue 35: the Files and Batch APIs with the `openai` package on `infermesh up --engines 1`.

- A file of 50 chat requests (32 tokens each) runs as a batch while 8 interactive streams run (bench/batch_api.py:
  the test prints the interactive TTFT p50 with the batch against without, never asserts a time); the
  output file has 50 lines, by custom_id.
- The edge killed with SIGKILL in the middle of a batch (30 lines): the launcher restarts it, the new edge takes the
  batch over from what the old one wrote to the cache service; then the cache service killed likewise; the
  output still has every line once.
- A cancelled batch stops: its lines under way are aborted in the engine (which is then idle), the lines not
  run are in the error file as batch_cancelled, each input line has exactly one result.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.batch_api import batch_file, compare, report, start_batch, under_way, wait_batch
from tests.e2e.conftest import OFFSET, Mesh, process_pid, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 1450           # apart from the meshes that may run beside it (tests/unit/test_mesh_groups.py)


@pytest.fixture(scope="module")
def batch_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(["--engines", "1"], PORTS, tmp_path_factory.mktemp("batches") / "infermesh-up.log") as m:
        yield m


@pytest.fixture(scope="module")
def client(batch_mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{batch_mesh.http}/v1", api_key="unused", max_retries=0, timeout=120)


def custom_ids(client: openai.OpenAI, file_id: str | None) -> list[str]:
    if not file_id:
        return []
    return [json.loads(line)["custom_id"] for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_beside_interactive_streams(batch_mesh: Mesh, client: openai.OpenAI) -> None:
    result = compare(batch_mesh.http, lines=50, streams=8, rounds=2, line_tokens=32)
    print("\n" + report(result, 50))
    batch = result["batch"]
    assert batch.status == "completed" and batch.request_counts.completed == 50 and batch.error_file_id is None
    assert [o["custom_id"] for o in result["output"]] == [f"line-{i}" for i in range(50)]
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["usage"]["completion_tokens"] == 32
               for o in result["output"])


def engine_running(mesh: Mesh) -> float:
    text = httpx.get(f"http://127.0.0.1:{mesh.engine_metrics_port}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^infermesh_engine_requests_running\{[^}]*\} (\S+)$", text, re.M))


def test_a_cancelled_batch_stops(batch_mesh: Mesh, client: openai.OpenAI) -> None:
    batch = start_batch(client, 50, "cancel")
    under_way(client, batch.id)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_batch(client, batch.id, 120)
    assert done.status == "cancelled" and done.cancelled_at and done.request_counts.completed < 50
    ok, failed = custom_ids(client, done.output_file_id), custom_ids(client, done.error_file_id)
    assert sorted(ok + failed) == sorted(f"line-{i}" for i in range(50))       # each line once
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]  # type: ignore[arg-type]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and len(ok) == done.request_counts.completed
    deadline = time.monotonic() + 30
    while engine_running(batch_mesh):                       # its lines under way were aborted, nothing else began
        assert time.monotonic() < deadline, "the engine still runs the cancelled batch's lines"
        time.sleep(0.2)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(start_and_finish(client).id)


def start_and_finish(client: openai.OpenAI) -> Any:
    upload = client.files.create(file=("one.jsonl", io.BytesIO(batch_file(1, "one", max_tokens=2))), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    return wait_batch(client, batch.id, 120)


def test_a_batch_outlives_its_edge_and_its_cache_service(batch_mesh: Mesh, client: openai.OpenAI) -> None:
    batch = start_batch(client, 30, "killed", line_tokens=32)
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 5:      # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    edge = process_pid(f"services.edge --replica-id edge-0 --host 127.0.0.1 --http-port {8000 + PORTS}")
    os.kill(edge, signal.SIGKILL)
    cache_killed = False
    deadline = time.monotonic() + 180
    while True:
        try:
            done = client.batches.retrieve(batch.id)
            if done.status == "completed":
                break
            if not cache_killed and done.request_counts.completed >= 15:          # type: ignore[union-attr]
                # Then the cache service that holds the batch's state: the edge keeps its results and
                # writes them once the launcher has restarted it.
                os.kill(process_pid(f"services.cache --replica-id cache-0 --port {50053 + PORTS}"), signal.SIGKILL)
                cache_killed = True
        except (openai.APIConnectionError, openai.InternalServerError):
            pass                                      # the edge or the cache service is restarting
        assert time.monotonic() < deadline, "the batch did not complete after its edge and cache were killed"
        time.sleep(0.5)
    assert cache_killed
    assert done.request_counts.completed == 30 and done.error_file_id is None
    assert custom_ids(client, done.output_file_id) == [f"line-{i}" for i in range(30)]
    log = Path(batch_mesh.log).read_text()
    assert re.search(rf"batch {batch.id} of \S+: taken over", log), log[-3000:]
