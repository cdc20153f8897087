"""Soak under chaos: N minutes (default 10) of mixed traffic at ~70% of measured capacity while one
process at a time is killed (SIGKILL) or hung (SIGSTOP, SIGCONT after a while), every kind covered.

    .venv/bin/python bench/soak.py [--minutes 10] [--load 0.7] [--json soak.json]

The mesh: `infermesh up --routers 2 --tokenizers 2 --engines 2 --dtype float32` (float32: greedy text
does not depend on the replica or the batch) with the launcher restarting what dies, API keys of three
tenants in three tiers of weights 1, 2 and 3 (a keys file and a tiers file: the engines share their steps
between the tenants by those weights) and an admin key, which loads a LoRA adapter of the default model at
start.  First, fault free: each prompt's greedy answer (the reference) on every kind, and the capacity
(requests per second, 8 at a time).  Then Poisson arrivals at `--load` x capacity (in requests: a session
arrival is 3 requests, a chain 2), each as a tenant drawn at random, a mix (bench/soak_calls.py) of chat
over HTTP/1.1 streamed and not, HTTP/3 streamed, native gRPC (mesh.clients.router_pool.RouterPool over
both routers), 3-turn sessions over HTTP/1.1, the Responses API whole and streamed, 2-turn Responses chains
(previous_response_id), chat through the LoRA adapter; and every --batch-every seconds a batch of
--batch-lines chat lines (/v1/files + /v1/batches; bench/soak_batches.py), its lines checked at the end.
Each request ends as one of:
  completed  its text equals the reference (every token: none lost, none repeated)
  error      a precise retryable answer: HTTP 429/503 (+ Retry-After) or an error event naming the
             cause, gRPC UNAVAILABLE / RESOURCE_EXHAUSTED
  lost       anything else: other text (cut short, repeated, history forgotten), another error, no
             answer within --request-timeout (hung), a batch line without exactly one result equal to
             the reference, a batch not finished --batch-grace seconds after the traffic ended (hung)
Chaos, in turn every --chaos-every seconds: kill engine-0, stop engine-1, kill router-0, stop
router-1, kill tokenizer-0, stop tokenizer-1, kill cache-0, stop cache-0.  The replicas only ever
stopped (and the edge) live through the whole soak: their memory at the start (after warm-up) and
the end is the leak check (growth under 10%); the others' is shown from their last start.  Exits 1 when
a request was lost, a batch hung or a process grew too much.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.soak_batches import Batches  # noqa: E402
from bench.soak_calls import CHAINS, LORA, NAMES, PROMPTS, SESSIONS, TENANTS, TOPICS, Soak  # noqa: E402
from bench.soak_report import memory, pid_of, report  # noqa: E402
from infermesh.launcher import http_ok  # noqa: E402
from mesh import credentials, models  # noqa: E402
from mesh.clients.router_pool import RouterPool  # noqa: E402
from mesh.models import home  # noqa: E402

MIX = (("http1-stream", 0.17), ("http1", 0.10), ("http3-stream", 0.12), ("grpc", 0.10), ("session", 0.15),
       ("responses", 0.08), ("responses-stream", 0.08), ("responses-chain", 0.08), ("lora", 0.12))
TURNS = {"session": 3, "responses-chain": 2}          # requests per arrival (1 for the others)
SINGLE = [k for k, _ in MIX if k not in TURNS]
KINDS = [k for k, _ in MIX] + ["batch-create", "batch-line"]
CHAOS = (("kill", "engine", 0), ("stop", "engine", 1), ("kill", "router", 0), ("stop", "router", 1),
         ("kill", "tokenizer", 0), ("stop", "tokenizer", 1), ("kill", "cache", 0), ("stop", "cache", 0))
ADMIN_KEY = "soak-admin-key"


async def chaos(soak: Soak, offset: int, stop_at: float) -> None:
    """One fault at a time, in turn, until `stop_at`; SIGSTOPped processes get SIGCONT after --stop-seconds."""
    i = 0
    await asyncio.sleep(soak.a.chaos_every / 2)
    while time.monotonic() + soak.a.stop_seconds < stop_at:
        action, kind, index = CHAOS[i % len(CHAOS)]
        name = f"{kind}-{index}"
        pid = pid_of(name, offset)
        if pid is None:             # still restarting from an earlier kill: wait for it
            await asyncio.sleep(1)
            continue
        soak.faults.append((time.monotonic(), f"{action} {name}"))
        print(f"[{time.strftime('%H:%M:%S')}] chaos: {action} {name} (pid {pid})", flush=True)
        if action == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(soak.a.stop_seconds)
            os.kill(pid, signal.SIGCONT)
        i += 1
        await asyncio.sleep(soak.a.chaos_every)


async def traffic(soak: Soak, rate: float, stop_at: float, seed: int) -> None:
    """Poisson arrivals at `rate` arrivals/s until `stop_at`, then every request under way to its end."""
    rng = random.Random(seed)
    kinds, weights = [k for k, _ in MIX], [w for _, w in MIX]
    tasks: set[asyncio.Task[None]] = set()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=soak.a.request_timeout, limits=limits) as client:
        while time.monotonic() < stop_at:
            kind = rng.choices(kinds, weights)[0]
            task = asyncio.create_task(soak.one(client, kind, random.Random(rng.getrandbits(64))))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


async def references(soak: Soak) -> None:
    """Fault free: every prompt once per kind (they must agree where they share a reference), every session
    script and Responses chain once per topic; 4 at a time (float32: the batch changes no answer)."""
    gate = asyncio.Semaphore(4)

    async def once(i: int, what: Any) -> None:
        async with gate:
            await what(TENANTS[i % len(TENANTS)])

    async with httpx.AsyncClient(timeout=soak.a.request_timeout) as c:
        jobs: list[Any] = [lambda t, k=kind, p=prompt, s=stream: soak.measure(k, soak.call(c, k, p, t, s),
                                                                             soak.key(k, p), t)
                           for prompt in PROMPTS for kind in SINGLE
                           for stream in ((False, True) if kind == "lora" else (False,))]
        jobs += [lambda t, s=script, x=topic: soak.session(c, t, s, x, random.getrandbits(64))
                 for script in SESSIONS for topic in TOPICS]
        jobs += [lambda t, s=script, x=name: soak.chain(c, t, s, x, random.Random(3))
                 for script in CHAINS for name in NAMES]
        await asyncio.gather(*(once(i, job) for i, job in enumerate(jobs)))
    bad = [o for o in soak.outcomes if o.result != "completed"]
    assert not bad, bad[:5]
    count = sum(soak.references.get(("lora", p)) != soak.references[(p,)] for p in PROMPTS)
    print(f"references: {len(soak.references)} ({len(soak.outcomes)} requests); the adapter's answer differs "
          f"from the base model's for {count} of {len(PROMPTS)} prompts", flush=True)
    soak.outcomes.clear()


async def capacity(soak: Soak, seconds: float, concurrency: int) -> float:
    """Requests per second, `concurrency` at a time, the traffic's mix without sessions and chains, fault free."""
    done = 0
    stop_at = time.monotonic() + seconds
    rng = random.Random(1)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await soak.one(client, rng.choice(SINGLE), random.Random(rng.getrandbits(64)))
            done += 1

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=soak.a.request_timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    bad = [o for o in soak.outcomes if o.result != "completed"]
    assert not bad, bad[:3]
    soak.outcomes.clear()
    return done / (time.monotonic() - started)


def settings(workdir: Path) -> dict[str, str]:
    """The keys file (a key per tenant, its tier), the tiers file (their weights) and the admin key."""
    keys, tiers = workdir / "keys.txt", workdir / "tiers.json"
    keys.write_text("".join(f"{t.key} tenant={t.name} tier={t.tier}\n" for t in TENANTS))
    tiers.write_text(json.dumps({t.tier: {"weight": t.weight, **({"cache_class": "premium"} if t.tier == "premium"
                                                                 else {})} for t in TENANTS}))
    # The prompts repeat (each is checked against its reference answer): with the edge's response cache on,
    # most would be answered from it, and the soak would no longer load the engines.
    return {"INFERMESH_EDGE_RESPONSE_CACHE_TTL": "0", "INFERMESH_API_KEYS_FILE": str(keys),
            "INFERMESH_TIERS_FILE": str(tiers), "INFERMESH_ADMIN_KEYS": ADMIN_KEY}


async def load_adapter(http: str, folder: Path) -> None:
    """A PEFT adapter of the default model (random factors on every projection), loaded through the edge."""
    from transformers import AutoConfig

    from tests.lora_adapters import random_adapter

    random_adapter(AutoConfig.from_pretrained(str(models.path("default"))), folder, seed=7, rank=8)
    async with httpx.AsyncClient(timeout=300) as client:
        reply = await client.post(f"{http}/v1/load_lora_adapter", json={"lora_name": LORA, "lora_path": str(folder)},
                                  headers={"authorization": f"Bearer {ADMIN_KEY}"})
    if reply.status_code != 200:
        raise SystemExit(f"loading the LoRA adapter: {reply.status_code} {reply.text}")
    print(f"LoRA adapter {LORA} loaded: {reply.json().get('message')}", flush=True)


async def soak_run(a: argparse.Namespace, http: str, offset: int, workdir: Path) -> int:
    credentials.configure(home() / "mesh-ca" / "client")
    routers = [f"127.0.0.1:{50051 + offset}", f"127.0.0.1:{50031 + offset}"]
    soak = Soak(a, http, 8443 + offset, routers)
    soak.pool = RouterPool(routers)
    soak.pool.start()
    await load_adapter(http, workdir / "adapter")
    await references(soak)
    cap = await capacity(soak, a.capacity_seconds, 8)
    print(f"capacity: {cap:.2f} requests/s (8 at a time, fault free)", flush=True)
    before = memory(offset)
    per_arrival = sum(w * TURNS.get(k, 1) for k, w in MIX) / sum(w for _, w in MIX)
    rate = a.load * cap / per_arrival
    stop_at = time.monotonic() + a.minutes * 60
    batches = Batches(soak)
    await asyncio.gather(traffic(soak, rate, stop_at, a.seed), chaos(soak, offset, stop_at),
                         batches.every(stop_at, a.seed + 1))
    print(f"[{time.strftime('%H:%M:%S')}] traffic ended; waiting for {len(batches.submitted)} batches", flush=True)
    await batches.check(time.monotonic() + a.batch_grace)
    await asyncio.sleep(5)
    after = memory(offset)
    result = report(soak, KINDS, rate * per_arrival, cap, before, after, a.recovery_seconds)
    result.update(minutes=a.minutes, load=a.load, cpu=_cpu(), batches=batches.summary(),
                  tenants_config=[t._asdict() for t in TENANTS])
    print(f"batches: {result['batches']}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    await soak.pool.close()
    return 1 if result["rows"][-1]["lost"] or batches.hung or not result["memory_ok"] else 0


async def run(a: argparse.Namespace) -> int:
    offset = a.port_offset
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    log = (workdir / "infermesh-up.log").open("wb")
    argv = [sys.executable, "-m", "infermesh.cli", "up", "--routers", "2", "--tokenizers", "2", "--engines", "2",
            "--dtype", "float32", "--kv-cache-mb", "256", "--port-offset", str(offset),
            "--cache-dir", str(workdir / "cache")]
    mesh = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1],
                            env={**os.environ, **settings(workdir)})
    http = f"http://127.0.0.1:{8000 + offset}"
    print(f"mesh log: {workdir / 'infermesh-up.log'}", flush=True)
    try:
        deadline = time.monotonic() + 300
        while not http_ok(f"{http}/health"):
            if mesh.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the mesh did not start; see {workdir / 'infermesh-up.log'}")
            await asyncio.sleep(0.5)
        return await soak_run(a, http, offset, workdir)
    finally:
        mesh.send_signal(signal.SIGTERM)
        try:
            mesh.wait(60)
        except subprocess.TimeoutExpired:
            mesh.kill()


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        return f"{model}, {os.cpu_count()} CPUs"
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--load", type=float, default=0.7, help="share of the measured capacity offered")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--chaos-every", type=float, default=20.0, help="seconds between faults")
    p.add_argument("--stop-seconds", type=float, default=8.0, help="how long a SIGSTOPped process stays stopped")
    p.add_argument("--recovery-seconds", type=float, default=20.0,
                   help="a request counts as during a fault when it overlaps one's first N seconds")
    p.add_argument("--capacity-seconds", type=float, default=40.0)
    p.add_argument("--request-timeout", type=float, default=180.0, help="no answer by then: hung (lost)")
    p.add_argument("--batch-every", type=float, default=60.0, help="seconds between two batches")
    p.add_argument("--batch-lines", type=int, default=6, help="chat lines per batch")
    p.add_argument("--batch-grace", type=float, default=300.0,
                   help="seconds after the traffic ends for every batch to finish; later: hung")
    p.add_argument("--port-offset", type=int, default=3000)
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--json", default="", help="write the results here too")
    a = p.parse_args()
    raise SystemExit(asyncio.run(run(a)))


if __name__ == "__main__":
    main()
