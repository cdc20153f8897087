"""Soak under chaos: N minutes (default 10) of mixed traffic at ~70% of measured capacity while one
process at a time is killed (SIGKILL) or hung (SIGSTOP, SIGCONT after a while), every kind covered.

    .venv/bin/python bench/soak.py [--minutes 10] [--load 0.7] [--json soak.json]

The mesh: `infermesh up --routers 2 --tokenizers 2 --engines 2 --dtype float32` (float32: greedy text
does not depend on the replica or the batch) with the launcher restarting what dies.  First, fault
free: each prompt's greedy answer (the reference) and the capacity (requests per second, 8 at a
time).  Then Poisson arrivals at `--load` x capacity, a mix of HTTP/1.1 streamed and not, HTTP/3
streamed, native gRPC (mesh.clients.router_pool.RouterPool over both routers) and 3-turn sessions over
HTTP/1.1.  Each request ends as one of:
  completed  its text equals the reference (every token: none lost, none repeated)
  error      a precise retryable answer: HTTP 429/503 (+ Retry-After) or an error event naming the
             cause, gRPC UNAVAILABLE / RESOURCE_EXHAUSTED
  lost       anything else: other text (cut short, repeated, history forgotten), another error, no
             answer within --request-timeout (hung)
Chaos, in turn every --chaos-every seconds: kill engine-0, stop engine-1, kill router-0, stop
router-1, kill tokenizer-0, stop tokenizer-1, kill cache-0, stop cache-0.  The replicas only ever
stopped (and the edge) live through the whole soak: their memory at the start (after warm-up) and
the end is the leak check; the others' is shown from their last start.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infermesh.launcher import http_ok  # noqa: E402
from mesh import credentials  # noqa: E402
from mesh.clients.http3 import H3Client  # noqa: E402
from mesh.clients.router_client import GenerateSpec, Message, Sampling  # noqa: E402
from mesh.clients.router_pool import RouterPool  # noqa: E402
from mesh.models import home  # noqa: E402

MODEL = "smollm2-135m"
PROMPTS = [f"Write two sentences about {t}." for t in (
    "the sea", "a fox", "winter", "a violin", "the moon", "bread", "a river", "glaciers", "a market", "comets",
    "lighthouses", "owls", "rain", "a library", "bicycles", "tea")]
SESSIONS = [("My name is Ada and I like {x}.", "What do I like?", "Say my name."),
            ("I live near {x}.", "Where do I live?", "Describe it in three words.")]
TOPICS = ("mountains", "the coast", "a forest", "the desert")
MIX = (("http1-stream", 0.30), ("http1", 0.15), ("http3-stream", 0.20), ("grpc", 0.15), ("session", 0.20))
RETRYABLE_HTTP = {429, 503}
RETRYABLE_GRPC = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
CHAOS = (("kill", "engine", 0), ("stop", "engine", 1), ("kill", "router", 0), ("stop", "router", 1),
         ("kill", "tokenizer", 0), ("stop", "tokenizer", 1), ("kill", "cache", 0), ("stop", "cache", 0))
BASE_PORTS = {("engine", 0): 50060, ("engine", 1): 50061, ("router", 0): 50051, ("router", 1): 50031,
              ("tokenizer", 0): 50052, ("tokenizer", 1): 50041, ("cache", 0): 50053}


@dataclass
class Outcome:
    kind: str
    start: float
    end: float
    result: str                  # completed | error:<what> | lost:<why>
    during_fault: bool = False


@dataclass
class Soak:
    a: argparse.Namespace
    http: str
    h3_port: int
    routers: list[str]
    references: dict[tuple[str, ...], str] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)
    pool: RouterPool | None = None

    # -- one request per transport: (text, finish) or raise _Failed -------------------------
    def body(self, messages: list[dict[str, str]], stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": self.a.max_tokens,
                                "temperature": 0, "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def http1(self, client: httpx.AsyncClient, messages: list[dict[str, str]], stream: bool,
                    headers: dict[str, str] | None = None) -> str:
        url = f"{self.http}/v1/chat/completions"
        if not stream:
            reply = await client.post(url, json=self.body(messages, False), headers=headers)
            if reply.status_code != 200:
                _check_status(reply.status_code, reply.text, reply.headers)
            choice = reply.json()["choices"][0]
            _check_finish(choice["finish_reason"])
            return str(choice["message"]["content"])
        async with client.stream("POST", url, json=self.body(messages, True), headers=headers) as reply:
            if reply.status_code != 200:
                _check_status(reply.status_code, (await reply.aread()).decode(), reply.headers)
            return _sse([line async for line in reply.aiter_lines()])

    async def http3(self, messages: list[dict[str, str]]) -> str:
        payload = json.dumps(self.body(messages, True)).encode()
        async with H3Client("127.0.0.1", self.h3_port, verify=False, timeout=self.a.request_timeout) as c, \
                c.stream("POST", "/v1/chat/completions", {"content-type": "application/json"}, payload) as s:
            raw = b"".join([chunk async for chunk in s.chunks()]).decode()
            if s.status != 200:
                _check_status(s.status, raw, s.headers)
            return _sse(raw.splitlines())

    async def native(self, prompt: str) -> str:
        assert self.pool is not None
        spec = GenerateSpec(model=MODEL, messages=(Message("user", prompt),),
                            request_id=f"soak-{random.getrandbits(48):x}",
                            sampling=Sampling(temperature=0, max_tokens=self.a.max_tokens, ignore_eos=True))
        text, finish = [], None
        try:
            async for d in self.pool.generate(spec, timeout=self.a.request_timeout):
                text.append(d.text)
                finish = d.finish_reason or finish
        except grpc.aio.AioRpcError as err:
            if err.code() in RETRYABLE_GRPC:
                raise _Failed(f"error:{err.code().name} {_cause(err.details() or '')}") from None
            raise _Failed(f"lost:grpc {err.code().name}: {err.details()}") from None
        _check_finish(finish)
        return "".join(text)

    # -- the traffic -----------------------------------------------------------------------
    def call(self, client: httpx.AsyncClient, kind: str, prompt: str) -> Any:
        """The coroutine function that sends `prompt` one way."""
        messages = [{"role": "user", "content": prompt}]
        return {"http1-stream": lambda: self.http1(client, messages, True),
                "http1": lambda: self.http1(client, messages, False),
                "http3-stream": lambda: self.http3(messages),
                "grpc": lambda: self.native(prompt)}[kind]

    async def one(self, client: httpx.AsyncClient, kind: str, rng: random.Random) -> None:
        if kind == "session":
            await self.session(client, rng.choice(SESSIONS), rng.choice(TOPICS), rng.getrandbits(64))
            return
        prompt = rng.choice(PROMPTS)
        await self.measure(kind, self.call(client, kind, prompt), (prompt,))

    async def session(self, client: httpx.AsyncClient, script: tuple[str, ...], topic: str, tag: int) -> None:
        """Three turns, each sending only its new message (x-session-id): the router keeps the rest."""
        sid = f"soak-{tag:x}"
        turns = [t.format(x=topic) for t in script]
        for k, turn in enumerate(turns):
            messages = [{"role": "user", "content": turn}]

            async def send(messages: list[dict[str, str]] = messages, stream: bool = k % 2 == 0) -> str:
                return await self.http1(client, messages, stream, {"x-session-id": sid})

            if not await self.measure("session", send, tuple(turns[:k + 1])):
                return          # an error ends the session (a client would retry the turn; we count it)

    async def measure(self, kind: str, call: Any, key: tuple[str, ...]) -> bool:
        start = time.monotonic()
        try:
            text = await asyncio.wait_for(call(), self.a.request_timeout)
            result = "completed" if text == self.references.get(key, text) else \
                f"lost:text differs ({len(text)} vs {len(self.references[key])} chars)"
            if key not in self.references:
                self.references[key] = text
        except _Failed as exc:
            result = str(exc)
        except TimeoutError:
            result = "lost:hung"
        except (httpx.HTTPError, OSError, ConnectionError) as exc:
            result = f"lost:{type(exc).__name__}: {exc}"
        self.outcomes.append(Outcome(kind, start, time.monotonic(), result))
        return result == "completed"


class _Failed(Exception):
    """A request that ended without its text: str() is `error:...` (retryable) or `lost:...`."""


CAUSES = (("session store", "session store unreachable"), ("no replica", "no engine replica free"),
          ("budget", "no engine replica free"), ("tokenizer", "tokenizer replicas down"),
          ("every router", "every router down"), ("engine", "engine failed"))


def _cause(message: str) -> str:
    """A short name for why a retryable error came (the message names the part that failed)."""
    return next((name for key, name in CAUSES if key in message), f"other: {message[:80]}")


def _check_status(status: int, text: str, headers: Any) -> None:
    try:
        message = str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = text
    if status in RETRYABLE_HTTP:
        hint = "" if headers.get("retry-after") else ", no Retry-After"
        raise _Failed(f"error:{status} {_cause(message)}{hint}")
    raise _Failed(f"lost:http {status}: {message[:200]}")


def _check_finish(finish: str | None) -> None:
    if finish != "length":
        raise _Failed(f"lost:finish {finish}")


def _sse(lines: list[str]) -> str:
    """The streamed text; an error event is a retryable error when it names a retryable cause."""
    text, finish = [], None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            err = event["error"]
            code = str(err.get("code") or err.get("type") or "")
            retryable = code in ("503", "429")          # the HTTP status the router's gRPC status maps to
            message = str(err.get("message"))
            raise _Failed(f"error:{code} {_cause(message)} (mid-stream)" if retryable else
                          f"lost:stream {code}: {message[:120]}")
        for choice in event.get("choices") or ():
            text.append(choice.get("delta", {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    _check_finish(finish)
    return "".join(text)


# -- the mesh and its processes ---------------------------------------------------------------
def pid_of(name: str, offset: int) -> int | None:
    kind, index = name.rsplit("-", 1)
    if kind == "edge":
        pattern = "services.edge --replica-id edge-0"
    else:
        pattern = f"services.{kind} --replica-id {name} --port {BASE_PORTS[(kind, int(index))] + offset}"
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return int(out[0]) if len(out) == 1 else None


def rss_mib(pid: int | None) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


PROCESSES = ("edge-0", "router-0", "router-1", "tokenizer-0", "tokenizer-1", "cache-0", "engine-0", "engine-1")


def memory(offset: int) -> dict[str, tuple[int | None, float]]:
    return {name: (pid, rss_mib(pid)) for name in PROCESSES for pid in [pid_of(name, offset)]}


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
    """Fault free: every prompt once per transport, every session script once per topic (they must agree)."""
    async with httpx.AsyncClient(timeout=soak.a.request_timeout) as client:
        for prompt in PROMPTS:
            for kind in ("http1", "http1-stream", "http3-stream", "grpc"):
                soak.outcomes.clear()
                await soak.measure(kind, soak.call(client, kind, prompt), (prompt,))
                assert soak.outcomes[-1].result == "completed", (kind, prompt, soak.outcomes[-1])
        for script in SESSIONS:
            for topic in TOPICS:
                soak.outcomes.clear()
                await soak.session(client, script, topic, random.getrandbits(64))
                assert all(o.result == "completed" for o in soak.outcomes), soak.outcomes
    soak.outcomes.clear()


async def capacity(soak: Soak, seconds: float, concurrency: int) -> float:
    """Requests per second, `concurrency` at a time, the traffic's mix without sessions, fault free."""
    done = 0
    stop_at = time.monotonic() + seconds
    rng = random.Random(1)
    kinds = [k for k, _ in MIX if k != "session"]

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            await soak.one(client, rng.choice(kinds), random.Random(rng.getrandbits(64)))
            done += 1

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=soak.a.request_timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    bad = [o for o in soak.outcomes if o.result != "completed"]
    assert not bad, bad[:3]
    soak.outcomes.clear()
    return done / (time.monotonic() - started)


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def report(soak: Soak, rate: float, cap: float, before: dict[str, tuple[int | None, float]],
           after: dict[str, tuple[int | None, float]], recovery_s: float) -> dict[str, Any]:
    for o in soak.outcomes:
        o.during_fault = any(t <= o.end and o.start <= t + recovery_s for t, _ in soak.faults)
    rows: list[dict[str, Any]] = []
    for kind in [k for k, _ in MIX] + ["all"]:
        mine = [o for o in soak.outcomes if kind in ("all", o.kind)]
        errors: dict[str, int] = {}
        for o in mine:
            if o.result.startswith("error:"):
                errors[o.result[6:]] = errors.get(o.result[6:], 0) + 1
        lost = [o.result[5:] for o in mine if o.result.startswith("lost:")]
        rows.append({"kind": kind, "requests": len(mine), "completed": sum(o.result == "completed" for o in mine),
                     "errors": errors, "lost": len(lost), "lost_why": sorted(set(lost))[:5],
                     "p99_during_faults_s": percentile([o.end - o.start for o in mine if o.during_fault], 99),
                     "p99_otherwise_s": percentile([o.end - o.start for o in mine if not o.during_fault], 99)})
    tally: dict[str, int] = {}
    for _, fault in soak.faults:
        action, name = fault.split()
        key = f"{action} {name.rsplit('-', 1)[0]}"
        tally[key] = tally.get(key, 0) + 1
    print(f"\ncapacity {cap:.2f} req/s fault free; offered {rate:.2f} req/s ({rate / cap:.0%}); "
          f"{len(soak.faults)} faults: " + ", ".join(f"{k} x{v}" for k, v in sorted(tally.items())))
    print("| traffic | requests | completed | errors (retryable) | lost | p99 during faults | p99 otherwise |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        errs = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"
        print(f"| {r['kind']} | {r['requests']} | {r['completed']} | {errs} | {r['lost']} | "
              f"{r['p99_during_faults_s']:.2f} s | {r['p99_otherwise_s']:.2f} s |")
    for r in rows:
        if r["lost"]:
            print(f"  lost ({r['kind']}): {r['lost_why']}")
    print("\n| process | RSS at start (MiB) | RSS at end (MiB) | growth | restarted |")
    print("|---|---:|---:|---:|---|")
    memory_rows = {}
    for name in PROCESSES:
        (pid0, rss0), (pid1, rss1) = before[name], after[name]
        restarted = pid0 != pid1
        growth = (rss1 - rss0) / rss0 if not restarted else float("nan")
        memory_rows[name] = {"start_mib": round(rss0, 1), "end_mib": round(rss1, 1), "restarted": restarted,
                             "growth": None if restarted else round(growth, 4)}
        print(f"| {name} | {rss0:.0f} | {rss1:.0f} | {'-' if restarted else f'{growth:+.1%}'} | "
              f"{'yes' if restarted else 'no'} |")
    return {"capacity_rps": cap, "offered_rps": rate, "faults": [f for _, f in soak.faults], "rows": rows,
            "memory": memory_rows}


async def run(a: argparse.Namespace) -> int:
    offset = a.port_offset
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    log = (workdir / "infermesh-up.log").open("wb")
    argv = [sys.executable, "-m", "infermesh.cli", "up", "--routers", "2", "--tokenizers", "2", "--engines", "2",
            "--dtype", "float32", "--kv-cache-mb", "256", "--port-offset", str(offset),
            "--cache-dir", str(workdir / "cache")]
    # The prompts repeat (each is checked against its reference answer): with the edge's response cache on,
    # most would be answered from it, and the soak would no longer load the engines.
    env = {**os.environ, "INFERMESH_EDGE_RESPONSE_CACHE_TTL": "0"}
    mesh = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1],
                            env=env)
    http = f"http://127.0.0.1:{8000 + offset}"
    print(f"mesh log: {workdir / 'infermesh-up.log'}", flush=True)
    try:
        deadline = time.monotonic() + 300
        while not http_ok(f"{http}/health"):
            if mesh.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the mesh did not start; see {workdir / 'infermesh-up.log'}")
            await asyncio.sleep(0.5)
        credentials.configure(home() / "mesh-ca" / "client")
        routers = [f"127.0.0.1:{50051 + offset}", f"127.0.0.1:{50031 + offset}"]
        soak = Soak(a, http, 8443 + offset, routers)
        soak.pool = RouterPool(routers)
        soak.pool.start()
        await references(soak)
        cap = await capacity(soak, a.capacity_seconds, 8)
        print(f"capacity: {cap:.2f} requests/s (8 at a time, fault free)", flush=True)
        before = memory(offset)
        rate = a.load * cap
        stop_at = time.monotonic() + a.minutes * 60
        await asyncio.gather(traffic(soak, rate, stop_at, a.seed), chaos(soak, offset, stop_at))
        await asyncio.sleep(5)
        after = memory(offset)
        result = report(soak, rate, cap, before, after, a.recovery_seconds)
        result.update(minutes=a.minutes, load=a.load, cpu=_cpu())
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=2))
        await soak.pool.close()
        lost = result["rows"][-1]["lost"]
        return 1 if lost else 0
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
    p.add_argument("--port-offset", type=int, default=3000)
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--json", default="", help="write the results here too")
    a = p.parse_args()
    raise SystemExit(asyncio.run(run(a)))


if __name__ == "__main__":
    main()
