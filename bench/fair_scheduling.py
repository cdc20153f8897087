"""Fair scheduling between tenants inside an engine: a flood against a single user, and two tiers' split.

    .venv/bin/python bench/fair_scheduling.py [--flood 48] [--split-seconds 60] [--max-running 16]

Starts `infermesh up --engines 1` (ports offset 1400) with API keys for tenants alpha and beta (tier
"free", weight 1) and gamma (tier "premium", weight 3), and the engine's --max-running (its rows per
step) at 16 so that 48 streams cannot all run at once.  In one run, each with fair scheduling on, then
with fair scheduling but no row cap for light tenants (a fresh mesh, `--fair-slowdown 0`: flood only), then
off (a fresh mesh, `--fair-scheduling off`: flood only):

1. Idle: beta sends 4 requests of 64 tokens one after another: its time to first token (TTFT) and
   tokens/s with the engine to itself (the baseline).
2. Flood: alpha opens 48 streams of 256 tokens; once they stream, beta sends the same 4 requests.
   Beta's TTFT p50 against the idle one, and its tokens/s against its share: half the engine (two
   tenants of weight 1), the engine being what beta gets from it alone (its idle tokens/s; one stream
   decodes one token a step, so it could never take half of the flood's batched tokens/s, which is
   printed beside).  Off, beta's first request waits behind alpha's queue (the run gives up on it
   after --starved-after s).  Then the same with a batch-class flood (tenant delta, tier "jobs").
3. Split (fair scheduling on only): alpha (weight 1) and gamma (weight 3) each keep 24 streams
   open (alpha's all in the engine before gamma's start) for --split-seconds; the engine's tokens per
   tenant (infermesh_engine_tenant_tokens_total) over that window, whose ratio should be 3.

Every prompt carries a per-run tag, so the edge's response cache and the prefix cache answer nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.meshes import infermesh_up  # noqa: E402

OFFSET = 1400
KEYS = {"alpha": "fair-key-alpha", "beta": "fair-key-beta", "gamma": "fair-key-gamma", "delta": "fair-key-delta"}
KEYS_FILE = "fair-key-alpha tenant=alpha tier=free\nfair-key-beta tenant=beta tier=free\n" \
            "fair-key-gamma tenant=gamma tier=premium\nfair-key-delta tenant=delta tier=jobs\n"
TIERS = {"free": {"weight": 1}, "premium": {"weight": 3}, "jobs": {"class": "batch"}}
TOPICS = ("rivers", "owls", "copper", "tides", "maps", "bees", "glass", "comets", "salt", "ferns", "bridges",
          "violins")


@dataclass
class Flood:
    """What a flood's streams have sent so far: content chunks, and each stream's first one (monotonic)."""

    chunks: int = 0
    firsts: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Answer:
    ttft_s: float           # send -> first content
    seconds: float          # send -> last token
    tokens: int             # completion tokens (usage)


def prompt(tag: str, i: int) -> str:
    return f"[{tag}-{i}] Write a long story about {TOPICS[i % len(TOPICS)]} and the people who love them."


def stream(http: str, tenant: str, text: str, max_tokens: int, stop: threading.Event | None = None,
           timeout: float = 600, seen: Flood | None = None) -> Answer | None:
    """One streamed chat completion as `tenant`; None when `stop` is set first (the stream is closed).
    `seen` counts its content chunks and keeps the time.monotonic() of its first."""
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.7, "top_p": 0.95, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    started, first, tokens = time.perf_counter(), 0.0, 0
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    with httpx.stream("POST", f"{http}/v1/chat/completions", json=body, headers=headers, timeout=timeout) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if stop is not None and stop.is_set():
                return None
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{tenant}'s stream failed: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                if seen is not None:
                    seen.chunks += 1
                    if not first:
                        seen.firsts.append(time.monotonic())
                first = first or time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return Answer(first - started if first else float("inf"), time.perf_counter() - started, tokens)


def probe(http: str, tag: str, requests: int = 4, max_tokens: int = 64, give_up_s: float = 600) -> list[Answer]:
    """beta's requests, one after another; stops early (returning what it has) if one has no first token
    within give_up_s (starved)."""
    out: list[Answer] = []
    for i in range(requests):
        stop = threading.Event()
        timer = threading.Timer(give_up_s, stop.set)
        timer.start()
        try:
            answer = stream(http, "beta", prompt(tag, 100 + i), max_tokens, stop)
        finally:
            timer.cancel()
        if answer is None:
            out.append(Answer(give_up_s, give_up_s, 0))
            return out
        out.append(answer)
    return out


@contextmanager
def flooding(http: str, tenant: str, streams: int, max_tokens: int, tag: str) -> Iterator[Flood]:
    """`streams` streams of `tenant` open for the block (closed at its end)."""
    stop = threading.Event()
    seen = Flood()
    threads = [threading.Thread(target=stream, args=(http, tenant, prompt(tag, i), max_tokens, stop, 600, seen),
                                daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    try:
        yield seen
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def rate(answers: list[Answer]) -> float:
    """Tokens per second over the requests' whole time (their waits included)."""
    return sum(a.tokens for a in answers) / sum(a.seconds for a in answers)


def per_tenant(metrics_url: str, metric: str) -> dict[str, float]:
    """An engine metric by tenant label (the edge names a keys-file tenant "t:NAME": gateway/tenants.py)."""
    text = httpx.get(metrics_url, timeout=10).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(rf'^{metric}\{{[^}}]*tenant="([^"]+)"[^}}]*\}} (\S+)$', text, re.M)}


def tenant_tokens(metrics_url: str) -> dict[str, float]:
    return per_tenant(metrics_url, "infermesh_engine_tenant_tokens_total")


def step_figures(metrics_url: str) -> tuple[float, float, float]:
    """The engine's steps so far: (steps, rows summed over them, seconds summed over them)."""
    text = httpx.get(metrics_url, timeout=10).text

    def total(name: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return (total("infermesh_engine_batch_size_count"), total("infermesh_engine_batch_size_sum"),
            total("infermesh_engine_step_seconds_sum"))


def in_engine(metrics_url: str, tenant: str) -> int:
    """`tenant`'s requests the engine holds, running or waiting."""
    return int(sum(per_tenant(metrics_url, f"infermesh_engine_tenant_{kind}").get(f"t:{tenant}", 0)
                   for kind in ("running", "queued")))


@dataclass(frozen=True)
class FloodResult:
    idle: list[Answer]
    busy: list[Answer]
    engine_tokens_per_s: float      # every tenant's tokens/s while beta's requests ran (engine counter)
    flood: int                      # the flood's streams, and how many of them had sent a token
    flood_before_beta: int          # before beta's first token,
    flood_before_beta_done: int     # and before beta's last request ended
    steps: tuple[float, float, float] = (0.0, 0.0, 0.0)   # the engine's steps, rows, seconds while beta's ran

    @property
    def ttft_ratio(self) -> float:
        return statistics.median(a.ttft_s for a in self.busy) / statistics.median(a.ttft_s for a in self.idle)

    @property
    def share(self) -> float:
        """beta's share while both are busy: half the engine (two tenants of weight 1), the engine being what
        beta gets from it alone (its idle rate: one stream decodes a token a step, so it could not take half
        of the flood's batched tokens/s, engine_tokens_per_s, which is printed beside)."""
        return rate(self.idle) / 2

    @property
    def starved(self) -> bool:
        return any(a.tokens == 0 for a in self.busy)

    def lines(self, label: str) -> list[str]:
        order = (f"  {self.flood_before_beta} of the flood's {self.flood} streams had started before beta's first "
                 f"token, {self.flood_before_beta_done} before beta's last request ended")
        steps, rows, seconds = self.steps
        if steps:
            order += f"; the engine's steps meanwhile: {rows / steps:.1f} rows, {seconds / steps * 1000:.1f} ms"
        return [*self._lines(label), order]

    def _lines(self, label: str) -> list[str]:
        idle = statistics.median(a.ttft_s for a in self.idle)
        if self.starved:
            waited = sum(a.seconds for a in self.busy if a.tokens == 0)
            return [f"{label}: beta starved: no first token after {waited:.1f} s "
                    f"(idle TTFT p50 {idle * 1000:.0f} ms)"]
        busy = statistics.median(a.ttft_s for a in self.busy)
        ttfts = ", ".join(f"{a.ttft_s * 1000:.0f}" for a in self.busy)
        return [f"{label}: beta TTFT p50 {busy * 1000:.0f} ms ({ttfts}) vs idle {idle * 1000:.0f} ms "
                f"({self.ttft_ratio:.2f}x); beta {rate(self.busy):.1f} tokens/s, {rate(self.busy) / self.share:.2f} "
                f"of its share {self.share:.1f} (half its idle {rate(self.idle):.1f}; the engine's tokens/s while "
                f"busy {self.engine_tokens_per_s:.1f})"]


def flood_run(http: str, metrics_url: str, flood: int = 48, flood_tokens: int = 256, starved_after: float = 30.0,
              idle: list[Answer] | None = None, flooder: str = "alpha", requests: int = 4) -> FloodResult:
    """beta's `requests` idle (unless given), then under `flooder`'s flood of `flood` streams."""
    tag = uuid.uuid4().hex[:8]
    idle = idle if idle is not None else probe(http, tag + "i", requests)
    with flooding(http, flooder, flood, flood_tokens, tag) as seen:
        deadline = time.monotonic() + 120
        while seen.chunks < flood or in_engine(metrics_url, flooder) < flood:   # all of it in the engine
            if time.monotonic() > deadline:
                raise RuntimeError(f"the flood did not start: {seen.chunks} chunks, "
                                   f"{in_engine(metrics_url, flooder)} requests in the engine")
            time.sleep(0.1)
        before, started, steps = tenant_tokens(metrics_url), time.monotonic(), step_figures(metrics_url)
        busy = probe(http, tag + "b", requests, give_up_s=starved_after)
        after, done = tenant_tokens(metrics_url), time.monotonic()
        end = step_figures(metrics_url)
        steps = (end[0] - steps[0], end[1] - steps[1], end[2] - steps[2])
        firsts = list(seen.firsts)
    engine = sum(after.values()) - sum(before.values())
    beta_first = started + busy[0].ttft_s
    return FloodResult(idle, busy, engine / (done - started), flood, sum(f < beta_first for f in firsts),
                       sum(f < done for f in firsts), steps)


def split_run(http: str, metrics_url: str, seconds: float = 60.0, streams: int = 24, settle_s: float = 5.0
              ) -> dict[str, float]:
    """Tokens the engine computed for alpha (weight 1) and gamma (weight 3) over `seconds`, both saturating.

    Alpha's streams all reach the engine before gamma's start: two floods started together race, and the one
    whose first prompts land first runs them alone, its virtual time ahead of what its tokens show in the
    window; gamma then catches up for as long as the machine takes to prefill them (seconds, on a busy one)."""
    tag = uuid.uuid4().hex[:8]
    with flooding(http, "alpha", streams, 2048, tag + "a"):
        _all_in_engine(metrics_url, "alpha", streams)
        with flooding(http, "gamma", streams, 2048, tag + "g"):
            _all_in_engine(metrics_url, "gamma", streams)
            time.sleep(settle_s)                  # gamma's prefills done
            before = tenant_tokens(metrics_url)
            time.sleep(seconds)
            after = tenant_tokens(metrics_url)
            held = {t: in_engine(metrics_url, t) for t in ("alpha", "gamma")}
            if min(held.values()) < streams:
                raise RuntimeError(f"streams ended during the split (did a client's stream fail?): in the engine "
                                   f"{held} of {streams} each")
    return {t: after.get(f"t:{t}", 0.0) - before.get(f"t:{t}", 0.0) for t in ("alpha", "gamma")}


def _all_in_engine(metrics_url: str, tenant: str, streams: int, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while in_engine(metrics_url, tenant) < streams:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{tenant}'s {streams} streams did not reach the engine in {seconds:.0f} s: "
                               f"{in_engine(metrics_url, tenant)} did")
        time.sleep(0.1)


@contextmanager
def mesh(fair: bool, max_running: int, workdir: Path, slowdown: str = "") -> Iterator[tuple[str, str]]:
    """`infermesh up --engines 1` for the runs: (edge URL, engine metrics URL); `slowdown`: the engine's
    --fair-slowdown ("": its default)."""
    (workdir / "keys").write_text(KEYS_FILE)
    (workdir / "tiers.json").write_text(json.dumps(TIERS))
    env = {"INFERMESH_API_KEYS_FILE": str(workdir / "keys"), "INFERMESH_TIERS_FILE": str(workdir / "tiers.json"),
           "INFERMESH_EDGE_RESPONSE_CACHE_TTL": "0", "INFERMESH_ENGINE_MAX_RUNNING": str(max_running),
           "INFERMESH_ENGINE_FAIR_SCHEDULING": "on" if fair else "off"}
    if slowdown:
        env["INFERMESH_ENGINE_FAIR_SLOWDOWN"] = slowdown
    log = f"infermesh-up-{'fair' if fair else 'fifo'}{slowdown}.log"
    with infermesh_up(OFFSET, workdir / log, env) as http:
        yield http, f"http://127.0.0.1:{9100 + OFFSET}/metrics"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flood", type=int, default=48)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--split-seconds", type=float, default=60.0)
    p.add_argument("--starved-after", type=float, default=60.0)
    p.add_argument("--fair-slowdown", default="", metavar="X",
                   help="the engine's --fair-slowdown for the fair runs (default: the engine's)")
    a = p.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[1].split("\n")[0]
    print(f"{cpu.strip()} | {os.cpu_count()} CPUs | --max-running {a.max_running} | flood {a.flood} x 256 tokens")
    workdir = Path(tempfile.mkdtemp(prefix="bench-fair-"))
    with mesh(True, a.max_running, workdir, a.fair_slowdown) as (http, metrics):
        stream(http, "beta", "warm up", 4)
        fair = flood_run(http, metrics, a.flood, starved_after=a.starved_after)
        print(*fair.lines("fair scheduling on "), sep="\n")
        jobs = flood_run(http, metrics, a.flood, starved_after=a.starved_after, idle=fair.idle, flooder="delta")
        print(*jobs.lines("batch-class flood  "), sep="\n")
        split = split_run(http, metrics, a.split_seconds)
        print(f"split over {a.split_seconds:.0f} s: gamma (weight 3) {split['gamma']:.0f} tokens, alpha (weight 1) "
              f"{split['alpha']:.0f}: ratio {split['gamma'] / max(split['alpha'], 1):.2f} (target 3)")
    with mesh(True, a.max_running, workdir, "0") as (http, metrics):
        stream(http, "beta", "warm up", 4)
        uncapped = flood_run(http, metrics, a.flood, starved_after=a.starved_after)
        print(*uncapped.lines("no row cap (--fair-slowdown 0)"), sep="\n")
    with mesh(False, a.max_running, workdir) as (http, metrics):
        stream(http, "beta", "warm up", 4)
        fifo = flood_run(http, metrics, a.flood, starved_after=a.starved_after)
        print(*fifo.lines("fair scheduling off"), sep="\n")


if __name__ == "__main__":
    main()
