"""Chaos, end to end: engines stopped and killed under load; nothing may be lost.

A mesh of its own (faults would disturb the shared one): 2 engines in float32, whose greedy
output does not depend on which replica or batch produced it, so a stream that moved
mid-generation can be compared token for token with a fault-free run.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.e2e.conftest import OFFSET, Mesh, engine_pid, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 300
PROMPTS = [f"Write a short story about a {thing}." for thing in
           ("lighthouse", "fox", "violin", "glacier", "market", "comet")]
TOKENS = 48


@pytest.fixture(scope="module")
def chaos_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("chaos") / "infermesh-up.log"
    with running_mesh(["--engines", "2", "--dtype", "float32", "--kv-cache-mb", "128",
                       "--no-restart"], PORTS, log) as m:
        yield m


@pytest.fixture(scope="module")
def client(chaos_mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{chaos_mesh.http}/v1", api_key="unused", max_retries=0, timeout=300)


def in_flight(replica: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{9180 + PORTS}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(rf'^infermesh_router_in_flight\{{replica="{replica}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def stream(client: openai.OpenAI, prompt: str, progress: list[int], slot: int) -> dict[str, Any]:
    chunks = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finish, meta, usage = [], None, None, None
    for chunk in chunks:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            progress[slot] += 1
        meta = (chunk.model_extra or {}).get("infermesh") or meta
        usage = chunk.usage or usage
    return {"text": "".join(text), "finish": finish, "replica": meta and meta["replica"],
            "tokens": usage.completion_tokens if usage else None}


def run_all(client: openai.OpenAI, fault: Any = None) -> list[dict[str, Any]]:
    """The six streams at once; `fault()` runs once every stream is under way on both replicas."""
    progress = [0] * len(PROMPTS)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, client, p, progress, i) for i, p in enumerate(PROMPTS)]
        if fault is not None:
            deadline = time.monotonic() + 120
            while min(progress) < 4 or in_flight("engine-1") < 1:
                assert time.monotonic() < deadline, f"streams did not get under way: {progress}"
                time.sleep(0.05)
            fault()
        return [f.result(timeout=600) for f in futures]


def ask(client: openai.OpenAI, **extra: Any) -> str:
    reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=2, temperature=0, **extra)
    return str(reply.model_extra["infermesh"]["replica"])  # type: ignore[index]


@pytest.fixture(scope="module")
def fault_free(client: openai.OpenAI) -> list[dict[str, Any]]:
    results = run_all(client)
    assert all(r["finish"] == "length" and r["tokens"] == TOKENS for r in results)
    return results


def test_sigstopped_engine_streams_move_and_new_requests_avoid_it(client: openai.OpenAI,
                                                                  fault_free: list[dict[str, Any]]) -> None:
    pid = engine_pid(1, PORTS)
    stopped = threading.Event()

    def stop() -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped.set()

    try:
        results = run_all(client, stop)
        assert stopped.is_set()
        # Every stream completed, token for token as without the fault, finished by engine-0.
        assert [r["text"] for r in results] == [r["text"] for r in fault_free]
        assert all(r["finish"] == "length" and r["tokens"] == TOKENS for r in results)
        assert {r["replica"] for r in results} == {"engine-0"}
        # New requests, past the detection time (2 missed 1 s probes), go to the live replica.
        assert {ask(client) for _ in range(6)} == {"engine-0"}
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:                                        # re-admitted once its health checks pass again
        try:
            assert ask(client, extra_headers={"x-infermesh-replica": "engine-1"}) == "engine-1"
            break
        except openai.APIStatusError as err:
            assert err.status_code == 503 and time.monotonic() < deadline, err
            time.sleep(0.5)
    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(lambda _: ask(client), range(8))) == {"engine-0", "engine-1"}


def test_killed_engine_mid_stream_loses_nothing(client: openai.OpenAI, fault_free: list[dict[str, Any]]) -> None:
    pid = engine_pid(1, PORTS)
    results = run_all(client, lambda: os.kill(pid, signal.SIGKILL))
    assert [r["text"] for r in results] == [r["text"] for r in fault_free]
    assert all(r["finish"] == "length" and r["tokens"] == TOKENS for r in results)
    # The dead replica is isolated: new requests are served by the one left.
    assert {ask(client) for _ in range(4)} == {"engine-0"}
