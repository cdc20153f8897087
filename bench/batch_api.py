"""A batch (/v1/batches) beside interactive traffic: does it slow the interactive requests' first token?

    .venv/bin/python bench/batch_api.py [--lines 50] [--streams 8] [--rounds 4] [--batches 1]

Starts `infermesh up --engines 1` (ports offset 1600).  In one run:

1. Without a batch: `--rounds` rounds of `--streams` concurrent streamed chat requests (16 tokens, each
   prompt with a per-run tag so no cache answers it), each one's time to first token (TTFT).
2. With one: a file of `--lines` chat requests (64 tokens each) uploaded and run as a batch (the engines'
   batch class); once its lines are under way, the same rounds again.
3. The batch's end: its output file has a line per input, by custom_id.

Prints the interactive TTFT p50 with the batch against without (the target: within 1.25x), the batch's
lines/s, and the CPU it ran on.  Every request is sampled (temperature 0.7, top_p 0.95).

With `--batches N` (N > 1; issue 49's probe: 40 batches of 12 lines) the mesh has API keys, one tenant's key
posts the N batches and another tenant's sends the interactive rounds: every one of those must be served
(none refused) with its TTFT p50 within 3x of idle; the batches are cancelled at the end.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.engine import cpu_name  # noqa: E402
from bench.meshes import infermesh_up  # noqa: E402

OFFSET = 1600
MODEL = "smollm2-135m"
TOPICS = ("rivers", "owls", "copper", "tides", "maps", "bees", "glass", "comets", "salt", "ferns")


def batch_file(lines: int, tag: str, max_tokens: int = 64) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "max_tokens": max_tokens, "temperature": 0.7, "top_p": 0.95, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"[{tag}-{i}] Tell me about {TOPICS[i % len(TOPICS)]}."}]}})
        + "\n" for i in range(lines)).encode()


KEYS = ("k-batches", "k-interactive")        # --batches N: one tenant each


def ttft(http: str, text: str, max_tokens: int = 16, key: str = "") -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.7, "top_p": 0.95, "stream": True}
    started, first = time.perf_counter(), 0.0
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", f"{http}/v1/chat/completions", json=body, timeout=300, headers=headers) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not first and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - started
    if not first:
        raise RuntimeError("the stream sent no content")
    return first


def interactive(http: str, streams: int, rounds: int, tag: str, key: str = "") -> list[float]:
    """`rounds` rounds of `streams` concurrent requests: every request's TTFT (seconds; a refused one raises)."""
    out: list[float] = []
    def one(text: str) -> None:
        out.append(ttft(http, text, key=key))

    for r in range(rounds):
        threads = [threading.Thread(target=one, args=(f"[{tag}-{r}-{i}] Write a sentence about "
                                                       f"{TOPICS[i % len(TOPICS)]}.",)) for i in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return out


def start_batch(client: openai.OpenAI, lines: int, tag: str, line_tokens: int = 64) -> Any:
    upload = client.files.create(file=("batch.jsonl", io.BytesIO(batch_file(lines, tag, line_tokens))),
                                 purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_batch(client: openai.OpenAI, bid: str, seconds: float = 600, until: tuple[str, ...] = (
        "completed", "failed", "cancelled", "expired")) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        batch = client.batches.retrieve(bid)
        if batch.status in until:
            return batch
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {bid} still {batch.status} after {seconds:.0f} s: {batch.request_counts}")
        time.sleep(0.2)


def under_way(client: openai.OpenAI, bid: str, seconds: float = 120) -> None:
    """Until the batch has answered a line (so its lines are in the engine)."""
    deadline = time.monotonic() + seconds
    while (client.batches.retrieve(bid).request_counts or {"completed": 0}).completed < 1:   # type: ignore[union-attr]
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {bid} answered no line in {seconds:.0f} s")
        time.sleep(0.1)


def compare(http: str, lines: int = 50, streams: int = 8, rounds: int = 4, line_tokens: int = 64) -> dict[str, Any]:
    """Interactive TTFTs without and with a batch running (its lines `line_tokens` long), and its outcome."""
    client = openai.OpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=120)
    tag = uuid.uuid4().hex[:8]
    interactive(http, streams, 1, tag + "w")                # warm up
    alone = interactive(http, streams, rounds, tag + "a")
    started = time.monotonic()
    batch = start_batch(client, lines, tag, line_tokens)
    under_way(client, batch.id)
    beside = interactive(http, streams, rounds, tag + "b")
    still_running = client.batches.retrieve(batch.id).status == "in_progress"
    done = wait_batch(client, batch.id)
    seconds = time.monotonic() - started
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()] \
        if done.output_file_id else []
    return {"alone": alone, "beside": beside, "batch": done, "output": out, "seconds": seconds,
            "overlapped": still_running,
            "ratio": statistics.median(beside) / statistics.median(alone)}


def compare_tenants(http: str, batches: int, lines: int, streams: int, rounds: int) -> dict[str, Any]:
    """Tenant A's `batches` batches of `lines` lines under way, tenant B's interactive rounds beside them."""
    owner = openai.OpenAI(base_url=f"{http}/v1", api_key=KEYS[0], max_retries=0, timeout=120)
    tag = uuid.uuid4().hex[:8]
    interactive(http, streams, 1, tag + "w", KEYS[1])
    alone = interactive(http, streams, rounds, tag + "a", KEYS[1])
    posted = [start_batch(owner, lines, f"{tag}-{b}") for b in range(batches)]
    under_way(owner, posted[0].id)
    beside = interactive(http, streams, rounds, tag + "b", KEYS[1])     # raises on any refusal
    counts = [owner.batches.retrieve(b.id).request_counts for b in posted]
    for b in posted:
        owner.batches.cancel(b.id)
    return {"alone": alone, "beside": beside, "ratio": statistics.median(beside) / statistics.median(alone),
            "lines_done": sum(c.completed for c in counts if c), "lines": batches * lines}


def report(result: dict[str, Any], lines: int) -> str:
    alone, beside = result["alone"], result["beside"]
    return (f"interactive TTFT p50 {statistics.median(beside) * 1000:.0f} ms with the batch running vs "
            f"{statistics.median(alone) * 1000:.0f} ms without: {result['ratio']:.2f}x (target <= 1.25x); "
            f"{len(beside)} requests each; batch of {lines} lines {result['batch'].status} in "
            f"{result['seconds']:.1f} s ({lines / result['seconds']:.2f} lines/s), "
            f"{'still running' if result['overlapped'] else 'ENDED'} when the interactive rounds ended")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=50)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batches", type=int, default=1, help="N > 1: one tenant's N batches, another's rounds")
    a = p.parse_args()
    if a.batches > 1:
        log = Path(tempfile.mkdtemp(prefix="bench-batch-")) / "infermesh-up.log"
        print(f"{cpu_name()} | tenant A: {a.batches} batches x {a.lines} lines | tenant B: {a.streams} streams x "
              f"{a.rounds} rounds")
        with infermesh_up(OFFSET, log, {"INFERMESH_EDGE_RESPONSE_CACHE_TTL": "0",
                                        "INFERMESH_API_KEYS": ",".join(KEYS)}) as http:
            r = compare_tenants(http, a.batches, a.lines, a.streams, a.rounds)
        print(f"tenant B: {len(r['beside'])} of {len(r['beside'])} served beside the batches, TTFT p50 "
              f"{statistics.median(r['beside']) * 1000:.0f} ms vs {statistics.median(r['alone']) * 1000:.0f} ms "
              f"idle: {r['ratio']:.2f}x (target <= 3x); tenant A: {r['lines_done']} of {r['lines']} lines done")
        return
    print(f"{cpu_name()} | {a.lines} batch lines x 64 tokens | {a.streams} interactive streams x {a.rounds} rounds")
    log = Path(tempfile.mkdtemp(prefix="bench-batch-")) / "infermesh-up.log"
    with infermesh_up(OFFSET, log, {"INFERMESH_EDGE_RESPONSE_CACHE_TTL": "0"}) as http:
        result = compare(http, a.lines, a.streams, a.rounds)
    print(report(result, a.lines))
    ids = [o["custom_id"] for o in result["output"]]
    matched = ids == [f"line-{i}" for i in range(a.lines)]
    print(f"output file: {len(ids)} lines, custom_ids {'match' if matched else 'DO NOT match'}")


if __name__ == "__main__":
    main()
