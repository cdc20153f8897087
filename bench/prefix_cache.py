"""Time to first token with a repeated ~1,500-token prefix: cold (first time) vs warm (prefix cached).

Starts `infermesh up` (1 engine), then for each trial builds a fresh ~1,500-token document,
asks one question about it (cold: every token is prefilled) and then another question
about the same document (warm: the engine's prefix cache holds the document's blocks).
Prints both times to first token and their ratio; asserts nothing.

    .venv/bin/python bench/prefix_cache.py [--trials 3] [--prefix-tokens 1500] [--port-offset 600]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import INFERMESH, TEXTS, BenchError, stop, stream_one, wait_http  # noqa: E402


def document(trial: int, tokens: int) -> str:
    rng = random.Random(trial)
    sentences = [rng.choice(TEXTS) for _ in range(tokens // 18)]
    return f"Document {trial * 7919 % 10007}.\n" + " ".join(sentences)


async def measure(base: str, trials: int, prefix_tokens: int) -> list[tuple[float, float, int]]:
    url = f"{base}/v1/chat/completions"
    results = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        await stream_one(client, url, "smollm2-135m", [{"role": "user", "content": "Warm up."}], 4, 0.0)
        for trial in range(trials):
            doc = document(trial, prefix_tokens)
            ttft = []
            for question in ("What is the main topic?", "List two facts it states."):
                chat = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
                t0 = time.perf_counter()
                first, _, _ = await stream_one(client, url, "smollm2-135m", chat, 4, t0)
                ttft.append(first)
            usage = await client.post(url, json={"model": "smollm2-135m", "max_tokens": 1, "messages": [
                {"role": "system", "content": doc}, {"role": "user", "content": "x"}]})
            prompt_tokens = usage.json()["usage"]["prompt_tokens"]
            results.append((ttft[0], ttft[1], prompt_tokens))
            print(f"trial {trial}: prompt {prompt_tokens} tokens, cold TTFT {ttft[0] * 1e3:.0f} ms, "
                  f"warm TTFT {ttft[1] * 1e3:.0f} ms, {ttft[0] / ttft[1]:.1f}x", flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--port-offset", type=int, default=600)
    p.add_argument("--dtype", default="auto")
    a = p.parse_args()
    base = f"http://127.0.0.1:{8000 + a.port_offset}"
    log = Path("/tmp") / f"infermesh-prefix-bench-{a.port_offset}.log"
    command = [str(INFERMESH), "up", "--engines", "1", "--port-offset", str(a.port_offset), "--dtype", a.dtype]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                # the warm request must reach the engine, not the edge's response cache
                                env={**os.environ, "INFERMESH_EDGE_RESPONSE_CACHE_TTL": "0"})
        try:
            wait_http("infermesh", f"{base}/health", proc, 300, log)
            results = asyncio.run(measure(base, a.trials, a.prefix_tokens))
        except BenchError as exc:
            print(f"bench failed: {exc}", file=sys.stderr)
            return 1
        finally:
            stop(proc)
    cold = statistics.median(r[0] for r in results)
    warm = statistics.median(r[1] for r in results)
    print(f"\nmedian over {len(results)} trials, prompts of ~{results[0][2]} tokens:")
    print(f"  cold TTFT {cold * 1e3:.0f} ms, warm TTFT {warm * 1e3:.0f} ms")
    print(f"  prefix cache speed-up of time to first token: {cold / warm:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
