"""End to end, issue 20: no single point of failure.  `infermesh up --routers 2 --tokenizers 2
--engines 2` (float32, so greedy text does not depend on the replica or the batch): a router killed
with 8 streams in flight, a tokenizer killed, the cache service killed; nothing lost, text equal to
the fault-free run, sessions still remembered."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.e2e.conftest import OFFSET, Mesh, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 800
PROMPTS = [f"Tell me about the {thing}." for thing in
           ("moon", "sea", "forest", "desert", "city", "river", "mountain", "island")]
TOKENS = 40


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("replicated") / "infermesh-up.log"
    with running_mesh(["--routers", "2", "--tokenizers", "2", "--engines", "2", "--dtype", "float32",
                       "--kv-cache-mb", "128"], PORTS, log) as m:
        yield m


@pytest.fixture(scope="module")
def client(replicated: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{replicated.http}/v1", api_key="unused", max_retries=0, timeout=300)


def pid(service: str, index: int, port: int) -> int:
    pattern = f"services.{service} --replica-id {service}-{index} --port {port + PORTS}"
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, f"expected one process for {pattern!r}, found {out}"
    return int(out[0])


def edge_metric(mesh: Mesh, name: str) -> float:
    with urllib.request.urlopen(f"{mesh.http}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def stream(client: openai.OpenAI, prompt: str, progress: list[int], slot: int) -> dict[str, Any]:
    chunks = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finish, usage = [], None, None
    for chunk in chunks:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            progress[slot] += 1
        usage = chunk.usage or usage
    return {"text": "".join(text), "finish": finish, "tokens": usage.completion_tokens if usage else None}


def run_all(client: openai.OpenAI, fault: Any = None) -> list[dict[str, Any]]:
    """The eight streams at once; `fault()` runs once every one has sent a few chunks."""
    progress = [0] * len(PROMPTS)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(stream, client, p, progress, i) for i, p in enumerate(PROMPTS)]
        if fault is not None:
            deadline = time.monotonic() + 180
            while min(progress) < 4:
                assert time.monotonic() < deadline, f"streams did not get under way: {progress}"
                time.sleep(0.05)
            fault()
            assert max(progress) < TOKENS, "the fault came too late: a stream had already finished"
        return [f.result(timeout=600) for f in futures]


@pytest.fixture(scope="module")
def fault_free(client: openai.OpenAI) -> list[dict[str, Any]]:
    results = run_all(client)
    assert all(r["finish"] == "length" and r["tokens"] == TOKENS for r in results)
    return results


def test_a_router_killed_with_8_streams_in_flight_loses_nothing(replicated: Mesh, client: openai.OpenAI,
                                                                 fault_free: list[dict[str, Any]]) -> None:
    before = edge_metric(replicated, "infermesh_edge_router_failovers_total")
    victim = pid("router", 0, 50051)
    results = run_all(client, lambda: os.kill(victim, signal.SIGKILL))
    assert [r["text"] for r in results] == [r["text"] for r in fault_free]
    assert all(r["finish"] == "length" and r["tokens"] == TOKENS for r in results)
    # The edge spread the eight over both routers: those on the dead one moved, mid-stream.
    assert edge_metric(replicated, "infermesh_edge_router_failovers_total") - before >= 1
    # New requests go on meanwhile (the launcher restarts router-0 in the background).
    reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_a_killed_tokenizer_replica_costs_no_request(client: openai.OpenAI) -> None:
    os.kill(pid("tokenizer", 1, 50041), signal.SIGKILL)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda i: client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=3,
            temperature=0), range(12)))
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in replies)


def test_sessions_survive_a_killed_cache_service(replicated: Mesh, client: openai.OpenAI) -> None:
    def turn(content: str) -> str:
        reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": content}],
                                               max_tokens=6, temperature=0, extra_headers={"x-session-id": "s-20"})
        return str(reply.choices[0].message.content)

    first = turn("My name is Ada.")
    os.kill(pid("cache", 0, 50053), signal.SIGKILL)
    deadline = time.monotonic() + 90
    while "sessions kept in" not in replicated.log.read_text().partition("cache-0 restarted")[2]:
        assert time.monotonic() < deadline, "the cache service was not restarted"
        time.sleep(0.5)
    after = replicated.log.read_text().partition("cache-0 restarted")[2]
    assert re.search(r"sessions kept in \S+sessions\.jsonl \(1 brought back\)", after), after[-2000:]
    time.sleep(2)                                 # the router's session-store breaker closes again

    def prompt_tokens(**extra: Any) -> int:
        reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "And?"}],
                                               max_tokens=1, temperature=0, **extra)
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    # The second turn's prompt holds the first turn: the router merged the history the store brought back.
    alone, in_session = prompt_tokens(), prompt_tokens(extra_headers={"x-session-id": "s-20"})
    assert in_session >= alone + 8, (first, alone, in_session)
