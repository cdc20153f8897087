"""The response cache: a deterministic request answered by the model (the baseline) against the same
request answered from the edge's memory and from the cache service's shared tier, on one mesh.

    .venv/bin/python bench/response_cache.py [--requests 50] [--max-tokens 32]

Starts `infermesh up --engines 1` (ports offset 1300), then for each of `--requests` distinct prompts
(temperature 0): the first answer (the model; `Cache-Control: no-cache` is not sent, so it is stored),
the second (the edge's memory).  The edge is then killed and restarted by the launcher, and each prompt
asked again (the shared tier; the answer also refills the memory tier).  Prints, per path, the
client's wall time (HTTP/1.1 on loopback, httpx) and the edge's own time from its `Server-Timing`
header, p50 and p95, and the ratio of the model's p50 to the cache's.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.meshes import infermesh_up  # noqa: E402
from infermesh.launcher import http_ok  # noqa: E402

OFFSET = 1300
HTTP = f"http://127.0.0.1:{8000 + OFFSET}"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ask(client: httpx.Client, prompt: str, max_tokens: int) -> tuple[float, float | None, bool]:
    """(client ms, edge ms or None, from the cache)."""
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    started = time.perf_counter()
    reply = client.post(f"{HTTP}/v1/chat/completions", json=body)
    spent = (time.perf_counter() - started) * 1000
    reply.raise_for_status()
    timing = re.search(r"edge;dur=([0-9.]+)", reply.headers.get("server-timing", ""))
    return spent, float(timing.group(1)) if timing else None, reply.headers.get("x-infermesh-cache") == "hit"


def restart_edge() -> None:
    pattern = f"services.edge --replica-id edge-0 --host 127.0.0.1 --http-port {8000 + OFFSET}"
    pid = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()[0]
    os.kill(int(pid), signal.SIGKILL)
    time.sleep(1.0)
    deadline = time.monotonic() + 120
    while not http_ok(f"{HTTP}/health"):
        if time.monotonic() > deadline:
            raise SystemExit("the edge was not restarted")
        time.sleep(0.3)


def report(name: str, rows: list[tuple[float, float | None, bool]]) -> float:
    client = [r[0] for r in rows]
    edge = [r[1] for r in rows if r[1] is not None]
    hits = sum(r[2] for r in rows)
    line = f"{name:<22} client p50 {statistics.median(client):8.2f} ms  p95 {pct(client, 0.95):8.2f} ms"
    if edge:
        line += f"   edge p50 {statistics.median(edge):6.3f} ms  p95 {pct(edge, 0.95):6.3f} ms"
    print(f"{line}   ({hits}/{len(rows)} from the cache)")
    return statistics.median(client)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    log = Path(tempfile.mkdtemp(prefix="bench-response-cache-")) / "infermesh-up.log"
    with infermesh_up(OFFSET, log):
        prompts = [f"Give me one fact about the number {i}." for i in range(a.requests)]
        with httpx.Client(timeout=300) as client:
            ask(client, "warm up", 4)
            model = [ask(client, q, a.max_tokens) for q in prompts]
            memory = [ask(client, q, a.max_tokens) for q in prompts]
            restart_edge()
            shared = [ask(client, q, a.max_tokens) for q in prompts]
        print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[1].split("\n")[0]
              .strip(), f"| {os.cpu_count()} CPUs | {a.requests} prompts, max_tokens {a.max_tokens}")
        base = report("model (baseline)", model)
        mem = report("edge memory tier", memory)
        sha = report("shared tier (new edge)", shared)
        print(f"speedup at p50: memory {base / mem:.0f}x, shared {base / sha:.0f}x")


if __name__ == "__main__":
    main()
