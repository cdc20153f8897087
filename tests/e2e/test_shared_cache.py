"""End to end: two engines share prompt KV through the cache service.

`infermesh up --engines 2 --dtype float32`: a ~800-token prompt computed on engine-0 is
loaded, not recomputed, by engine-1 (its cached tokens counted; the times to first token printed beside a
cold prompt's of the same length), with the same greedy answer; and killing the cache under load
fails no request.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import httpx
import pytest

from meshpb.v1 import cache_pb2, cache_pb2_grpc
from tests.e2e.conftest import OFFSET, Mesh, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 700
CACHE = f"127.0.0.1:{50053 + PORTS}"
BLOCK = 16


@pytest.fixture(scope="module")
def shared_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("shared-cache") / "infermesh-up.log"
    with running_mesh(["--engines", "2", "--dtype", "float32", "--no-restart"], PORTS, log) as m:
        yield m


def facts(opening: str, n: int = 26) -> str:
    """About 28 tokens a fact: 26 make a ~800-token prompt with the chat template (50 blocks)."""
    colors = ["red", "white", "blue", "green", "grey"]
    body = " ".join(f"Fact {i}: the {colors[i % 5]} lighthouse on island {i} was built in {1800 + 7 * i} and "
                    f"repainted {i % 5 + 2} times." for i in range(n))
    return f"{opening} {body} Which lighthouse is the oldest? Answer briefly."


class Answer(NamedTuple):
    ttft_s: float              # at the client: request sent -> first text delta
    text: str
    prompt_tokens: int
    cached_tokens: int
    replica: str


def ask(mesh: Mesh, content: str, replica: str, max_tokens: int = 16) -> Answer:
    body: dict[str, Any] = {"model": "smollm2-135m", "stream": True, "max_tokens": max_tokens, "temperature": 0,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": content}]}
    text: list[str] = []
    ttft = 0.0
    usage: dict[str, Any] = {}
    served = ""
    started = time.perf_counter()
    with httpx.stream("POST", f"{mesh.http}/v1/chat/completions", json=body, timeout=300,
                      headers={"x-infermesh-replica": replica}) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - started
                    text.append(choice["delta"]["content"])
            usage = chunk.get("usage") or usage
            served = chunk.get("infermesh", {}).get("replica", served)
    assert usage, "no usage chunk"
    return Answer(ttft, "".join(text), usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                  served)


def cache_stats(mesh: Mesh) -> cache_pb2.CacheStats:
    with mesh.sync_channel(CACHE) as ch:
        return cache_pb2_grpc.CacheStub(ch).GetStats(cache_pb2.CacheStatsRequest(), timeout=5)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_prefix_computed_on_one_replica_is_loaded_by_the_other(shared_mesh: Mesh, reference) -> None:  # type: ignore[no-untyped-def]
    for replica in ("engine-0", "engine-1"):           # first requests pay one-off costs; not measured
        ask(shared_mesh, f"Say hello to {replica}.", replica, max_tokens=2)
    before = cache_stats(shared_mesh).hot_blocks

    prompt = facts("Here are some facts about lighthouses.")
    a = ask(shared_mesh, prompt, "engine-0")
    assert a.replica == "engine-0" and 700 <= a.prompt_tokens <= 900
    # engine-0 publishes every full prompt block it computed: all but the system prompt's (cached by hello).
    wait_for(lambda: cache_stats(shared_mesh).hot_blocks >= before + a.prompt_tokens // BLOCK - 2,
             "engine-0 to publish its prompt blocks")
    time.sleep(0.5)                                  # and the last PutBlocks stream to end

    cold = ask(shared_mesh, facts("Some facts about lighthouses follow."), "engine-1")
    warm = ask(shared_mesh, prompt, "engine-1")
    print(f"\nTTFT, {a.prompt_tokens}-token prompt: engine-0 cold {a.ttft_s * 1000:.0f} ms; engine-1 with the "
          f"prefix from the cache {warm.ttft_s * 1000:.0f} ms ({warm.cached_tokens} cached tokens); engine-1, "
          f"a cold prompt of {cold.prompt_tokens} tokens {cold.ttft_s * 1000:.0f} ms "
          f"({cold.ttft_s / warm.ttft_s:.1f}x)")
    assert warm.replica == cold.replica == "engine-1"
    assert abs(cold.prompt_tokens - a.prompt_tokens) < 16
    assert warm.cached_tokens == (a.prompt_tokens - 1) // BLOCK * BLOCK
    assert cold.cached_tokens < 100                    # the system prompt at most
    # The speed-up is printed above, not asserted (a timed assertion fails on a busy shared machine: it
    # measured 2.97x once where it usually is 5-10x); the cached-token count is what proves the reuse.

    # The answer with the prefix loaded is the answer with it recomputed, and transformers' own.
    assert warm.text == a.text
    assert warm.text == reference(16, messages=[{"role": "user", "content": prompt}])

    # And the engines' Prometheus counters say so: engine-0 published, engine-1 fetched the blocks.
    published = shared_blocks(0, "engine-0", "published")
    fetched = shared_blocks(1, "engine-1", "fetched")
    assert published >= a.prompt_tokens // BLOCK - 2 and fetched >= warm.cached_tokens // BLOCK - 2


def shared_blocks(index: int, replica: str, event: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{9100 + index + PORTS}/metrics", timeout=10).text
    line = f'infermesh_engine_shared_cache_blocks_total{{event="{event}",replica="{replica}"}} '
    return float(next(row for row in text.splitlines() if row.startswith(line)).split()[-1])


def test_killing_the_cache_under_load_fails_no_request(shared_mesh: Mesh) -> None:
    prompts = [facts(f"Lighthouse list number {i}.", n=30) for i in range(4)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        running = [pool.submit(ask, shared_mesh, p, f"engine-{i % 2}") for i, p in enumerate(prompts)]
        time.sleep(1.5)                                # the engines are mid-prefill, publishing as they go
        pids = subprocess.run(["pgrep", "-f", f"services.cache --replica-id cache-0 --port {50053 + PORTS}"],
                              capture_output=True, text=True).stdout.split()
        assert len(pids) == 1, f"expected one cache process, found {pids}"
        os.kill(int(pids[0]), signal.SIGKILL)
        answers = [f.result() for f in running]
    assert all(a.text and a.prompt_tokens > 800 for a in answers)
    # With the cache gone, an engine recomputes what the other computed: same answer, nothing loaded.
    again = ask(shared_mesh, prompts[1], "engine-0")
    assert again.text == answers[1].text and again.cached_tokens < 100
    wait_for(lambda: "recomputing without it" in shared_mesh.log.read_text(), "the engines to notice", 10)
