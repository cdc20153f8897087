"""Discrete-event simulation: the router's real balancing policies over 8 simulated engines.

Every policy serves the same seeded workload: chat sessions over a long tail (Zipf 0.8) of
shared system prompts / documents, each turn extending the session's previous prompt and
answer.  Each engine is the engine's own scheduling code, driven in simulated time: the real
services/engine Scheduler (continuous batching, 512-token step budget, chunked prefill,
preemption) over the real BlockManager (paged KV, hash-chained prefix reuse, LRU eviction).
Only the model is replaced: a step takes the time a cost model gives, measured on this 2-core
CPU (20 ms + 4.6 ms per decoding sequence + 3.2 ms per prefilled token), and "samples" the
next token of the turn's scripted answer, so the next turn's prompt hits the blocks the answer
filled.  The policies are services/router/policies, fed Replica state the way the router feeds
it: in_flight at once, everything else from a LoadReport every --report-interval seconds.

Arrivals are Poisson at --load times round-robin's saturated throughput (measured first, on
the same workload), so the baseline runs loaded but stable and every gain comes from placement.

    .venv/bin/python bench/router_sim.py [--quick] [--seed 0] [--load 0.8] [--plot bench/router_sim.png]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mesh.prefix import block_hash  # noqa: E402
from services.engine.core.block_manager import BlockManager  # noqa: E402
from services.engine.core.request import Request, SamplingParams  # noqa: E402
from services.engine.core.scheduler import Batch, Scheduler, SchedulerConfig  # noqa: E402
from services.router.policies import POLICIES, Policy, PolicyConfig, RouteRequest  # noqa: E402
from services.router.replicas import LoadReport, Replica  # noqa: E402

# name[:field=value,...]: a registry name, optionally with PolicyConfig overrides.  The second
# balancing row trusts a P99 of any size, as the formula reads without p99_min_samples.
DEFAULT_POLICIES = ("round_robin", "least_load", "balancing", "balancing:p99_min_samples=1", "least_load+prefix",
                    "balancing+prefix", "balancing+prefix+session")


@dataclass(frozen=True)
class SimConfig:
    seed: int = 0
    sessions: int = 1000
    load: float = 0.8                 # offered load / round-robin's saturated throughput
    rate: float = 0.0                 # requests/s; overrides `load` when set
    replicas: int = 8
    # engine: services/engine defaults; the cost model's step times measured here (bench/engine.py)
    step_s: float = 0.020
    decode_s: float = 0.0046          # per running sequence that decodes this step
    prefill_s: float = 0.0032         # per prompt token computed
    step_tokens: int = 512            # max_batched_tokens
    max_running: int = 64
    block_size: int = 16
    kv_blocks: int = 1456             # kv_cache_mb=1024 over SmolLM2-135M's 45 KiB/token (fp32)
    report_interval_s: float = 0.25   # engines' WatchLoad interval
    # workload
    prefixes: int = 128               # shared system prompts / documents
    zipf: float = 0.8
    prefix_tokens: tuple[int, int] = (200, 2000)   # log-uniform
    header_tokens: int = 24           # the chat template's opening, shared by every prompt
    user_tokens: tuple[int, int] = (20, 200)
    output_tokens: tuple[int, int] = (32, 256)
    turns: tuple[float, ...] = (0.4, 0.25, 0.2, 0.15)   # P(1 turn), P(2), ...
    think_s: float = 5.0              # mean pause between an answer and the next turn


# -- workload -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    prompt_len: int                     # the prompt is the session's first prompt_len tokens
    out_len: int                        # the answer, the out_len tokens after it
    prompt_hashes: tuple[bytes, ...]    # full blocks of the prompt: what the router sees
    think_s: float                      # pause before the next turn


@dataclass(frozen=True)
class Session:
    key: str
    start: float
    tokens: tuple[int, ...]             # the whole conversation: every turn's prompt and answer
    turns: tuple[Turn, ...]


def _extend(hashes: list[bytes], tokens: Sequence[int], block: int) -> None:
    """Extend a chain of block hashes (mesh.prefix) over `tokens`, of which `hashes` covers a prefix."""
    for start in range(len(hashes) * block, len(tokens) - block + 1, block):
        hashes.append(block_hash(hashes[-1] if hashes else b"", tokens[start:start + block]))


def workload(cfg: SimConfig, rate: float) -> list[Session]:
    """Sessions with start times Poisson at `rate` requests/s (so sessions at rate / mean turns)."""
    rng = random.Random(cfg.seed)
    vocab = 49152
    header = [rng.randrange(vocab) for _ in range(cfg.header_tokens)]
    lo, hi = cfg.prefix_tokens
    docs = [header + [rng.randrange(vocab) for _ in range(int(math.exp(rng.uniform(math.log(lo), math.log(hi)))))]
            for _ in range(cfg.prefixes)]
    doc_hashes: list[list[bytes]] = []
    for text in docs:
        doc_hashes.append([])
        _extend(doc_hashes[-1], text, cfg.block_size)
    weights = [1.0 / (k + 1) ** cfg.zipf for k in range(cfg.prefixes)]
    mean_turns = sum((i + 1) * p for i, p in enumerate(cfg.turns))
    sessions: list[Session] = []
    t = 0.0
    for s in range(cfg.sessions):
        t += rng.expovariate(rate / mean_turns)
        doc = rng.choices(range(cfg.prefixes), weights)[0]
        tokens, hashes = list(docs[doc]), list(doc_hashes[doc])
        turns: list[Turn] = []
        for _ in range(rng.choices(range(1, len(cfg.turns) + 1), cfg.turns)[0]):
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(*cfg.user_tokens))]
            _extend(hashes, tokens, cfg.block_size)
            prompt_len, prompt_hashes = len(tokens), tuple(hashes)
            out_len = rng.randint(*cfg.output_tokens)
            tokens += [rng.randrange(vocab) for _ in range(out_len)]
            _extend(hashes, tokens, cfg.block_size)
            turns.append(Turn(prompt_len, out_len, prompt_hashes, rng.expovariate(1 / cfg.think_s)))
        sessions.append(Session(f"session-{s}", t, tuple(tokens), tuple(turns)))
    return sessions


# -- one engine --------------------------------------------------------------------------------
SAMPLING = SamplingParams()     # never read: the cost model stands in for the model and the sampler


class Job:
    """One request's life in the simulation, as the router sees it (the engine holds its Request)."""

    __slots__ = ("session", "index", "turn", "route", "arrival", "first_token", "finished", "engine", "cached",
                 "generated")

    def __init__(self, session: Session, index: int, arrival: float, route: RouteRequest):
        self.session, self.index, self.turn, self.route = session, index, session.turns[index], route
        self.arrival, self.first_token, self.finished = arrival, -1.0, -1.0
        self.engine = -1
        self.cached = self.generated = 0        # at the end: prompt tokens the prefix cache served, tokens made

    def answer(self, i: int) -> int:
        """The answer's i-th token: what the model "samples"."""
        return self.session.tokens[self.turn.prompt_len + i]


class SimEngine:
    """The engine's Scheduler and BlockManager (services/engine), stepped in simulated time.

    start_step() schedules a batch and returns how long the model would take on it; end_step()
    is the rest of Engine.step() once that time has passed: commit the batch's KV, append each
    sampled row's next token, finish requests whose answer is complete."""

    def __init__(self, cfg: SimConfig, replica: Replica):
        self.cfg, self.replica = cfg, replica
        self.blocks = BlockManager(cfg.kv_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.blocks, SchedulerConfig(max_batched_tokens=cfg.step_tokens,
                                                                max_running=cfg.max_running))
        self.jobs: dict[str, Job] = {}
        self.batch: Batch | None = None
        self.busy_s = 0.0
        self.preemptions = 0
        self.done: deque[tuple[float, float]] = deque()      # (finished at, latency s), last 10 s
        self.made: deque[tuple[float, int]] = deque()        # (step end, tokens sampled), last 10 s
        self.made_total = 0                                   # their sum

    def add(self, job: Job) -> None:
        request_id = f"{job.session.key}/{job.index}"
        self.jobs[request_id] = job
        self.scheduler.add(Request(request_id, list(job.session.tokens[:job.turn.prompt_len]), SAMPLING,
                                   max_tokens=job.turn.out_len))

    def step_seconds(self, batch: Batch) -> float:
        """The cost model: a fixed cost, one per decoding row, one per other token computed."""
        decodes = sum(1 for c in batch.chunks if c.num_tokens == 1 and c.start >= len(c.request.prompt_ids))
        return self.cfg.step_s + self.cfg.decode_s * decodes + self.cfg.prefill_s * (batch.num_tokens - decodes)

    def start_step(self) -> float:
        """Schedule the next batch; returns its duration, 0 when there is nothing to run."""
        batch = self.scheduler.schedule()
        self.preemptions += len(batch.preempted)
        self.batch = batch if batch.chunks else None
        return self.step_seconds(batch) if batch.chunks else 0.0

    def end_step(self, now: float) -> list[Job]:
        """The step's model run is over at `now`; returns the jobs it finished."""
        assert self.batch is not None
        self.scheduler.commit(self.batch)
        finished: list[Job] = []
        sampled = 0
        for chunk in self.batch.chunks:
            if not chunk.sample:
                continue
            req = chunk.request
            job = self.jobs[req.request_id]
            req.append(job.answer(req.num_generated))
            sampled += 1
            if req.num_generated == 1:
                job.first_token = now
            if req.num_generated == req.max_tokens:
                self.scheduler.finish(req)
                del self.jobs[req.request_id]
                job.cached, job.generated, job.finished = req.num_cached_tokens, req.num_generated, now
                self.done.append((now, now - job.arrival))
                finished.append(job)
        self.made.append((now, sampled))
        self.made_total += sampled
        self.batch = None
        return finished

    def report(self, now: float, window: float = 10.0) -> LoadReport:
        """What services/engine/rpcs/server.py load_report() would say now."""
        while self.done and self.done[0][0] <= now - window:
            self.done.popleft()
        while self.made and self.made[0][0] <= now - window:
            self.made_total -= self.made.popleft()[1]
        lat = sorted(s for _, s in self.done)

        def pct(p: float) -> float:
            return 1000.0 * lat[min(len(lat) - 1, int(p * len(lat)))] if lat else 0.0

        return LoadReport(running=len(self.scheduler.running), waiting=self.scheduler.num_waiting,
                          kv_blocks_total=self.blocks.num_blocks, kv_blocks_free=self.blocks.num_free_blocks,
                          qps=len(lat) / window, p50_latency_ms=pct(0.5), p99_latency_ms=pct(0.99),
                          tokens_per_second=self.made_total / window)

    def idle_and_empty(self) -> bool:
        """Nothing queued or running, and every KV block free or merely cached (no references)."""
        return not self.scheduler.has_work() and not self.jobs and self.blocks.num_used_blocks == 0


# -- the cluster and the router ---------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    policy: str
    requests: int
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    makespan_s: float
    latency_s: tuple[float, ...]     # end to end, sorted
    ttft_s: tuple[float, ...]        # sorted
    finish_s: tuple[float, ...]      # completion times, in request order
    entropy: float                   # mean of the policy's load_entropy, sampled once a second
    preemptions: int
    busy: float                      # mean fraction of the makespan the engines were stepping
    reasons: dict[str, int]

    @property
    def rps(self) -> float:
        return self.requests / self.makespan_s

    @property
    def tps(self) -> float:
        return self.output_tokens / self.makespan_s

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @staticmethod
    def pct(values: Sequence[float], p: float) -> float:
        return values[min(len(values) - 1, int(p * len(values)))]


def make(spec: str) -> Policy:
    """'balancing+prefix' or 'balancing:p99_min_samples=1,max_queued=8' -> the router's policy."""
    name, _, overrides = spec.partition(":")
    fields = {}
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        kind = type(getattr(PolicyConfig(), key))
        fields[key] = kind(value)
    return POLICIES[name](PolicyConfig(**fields))


def simulate(cfg: SimConfig, sessions: Sequence[Session], policy_name: str, users: int = 0) -> Result:
    """Run `sessions` through the cluster under `policy_name` (a spec for make()).

    users = 0: each session starts at its own start time (open loop).  users = N: closed loop,
    N users at once, each starting the next unstarted session when its last one ends."""
    policy = make(policy_name)
    replicas = [Replica(f"engine-{i}", "sim", model="m", healthy=True) for i in range(cfg.replicas)]
    engines = [SimEngine(cfg, r) for r in replicas]
    # (time, tiebreak, kind, session, index): index is the turn for ARRIVE, the engine for STEP.
    events: list[tuple[float, int, int, Session | None, int]] = []
    ARRIVE, STEP, REPORT, SAMPLE = 0, 1, 2, 3
    counter = 0

    def push(t: float, kind: int, session: Session | None = None, index: int = 0) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, session, index))

    def step(e: int, now: float) -> None:
        duration = engines[e].start_step()
        if duration:
            engines[e].busy_s += duration
            push(now + duration, STEP, None, e)

    pending = deque(sessions)
    for _ in range(users or len(sessions)):
        if pending:
            s = pending.popleft()
            push(0.0 if users else s.start, ARRIVE, s, 0)
    push(0.0, REPORT)
    push(0.0, SAMPLE)
    stepping = [False] * cfg.replicas
    total = sum(len(s.turns) for s in sessions)
    jobs: list[Job] = []
    entropy: list[float] = []
    reasons: dict[str, int] = {}
    now = 0.0
    while events:
        now, _, kind, session, index = heapq.heappop(events)
        if kind == ARRIVE:
            assert session is not None
            route = RouteRequest("m", session_key=session.key, prefix_hashes=session.turns[index].prompt_hashes)
            job = Job(session, index, now, route)
            decision = policy.pick(replicas, route, now)
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
            job.engine = e = replicas.index(decision.replica)
            decision.replica.in_flight += 1
            policy.on_start(decision.replica, route, now)
            engines[e].add(job)
            jobs.append(job)
            if not stepping[e]:
                stepping[e] = True
                step(e, now)
        elif kind == STEP:
            e = index
            for job in engines[e].end_step(now):
                replicas[e].in_flight -= 1
                policy.on_finish(replicas[e], job.route, now, now - job.arrival, True)
                if job.index + 1 < len(job.session.turns):
                    push(now + job.turn.think_s, ARRIVE, job.session, job.index + 1)
                elif pending:
                    push(now, ARRIVE, pending.popleft(), 0)
            step(e, now)
            stepping[e] = engines[e].batch is not None
        elif len(jobs) < total or any(stepping):    # periodic events stop once all is done
            if kind == REPORT:
                for r, eng in zip(replicas, engines, strict=True):
                    r.apply_load(eng.report(now), now)
                push(now + cfg.report_interval_s, REPORT)
            else:
                entropy.append(policy.load_entropy(now))
                push(now + 1.0, SAMPLE)
    for eng in engines:    # conservation: everything admitted ran to the end and gave its blocks back
        if not eng.idle_and_empty():
            raise RuntimeError(f"{eng.replica.replica_id} ended holding work or KV blocks")
    if len(jobs) != total or any(j.finished < 0 for j in jobs) or any(r.in_flight for r in replicas):
        raise RuntimeError("a request was lost")
    start = min(j.arrival for j in jobs)
    end = max(j.finished for j in jobs)
    return Result(
        policy=policy_name, requests=len(jobs), output_tokens=sum(j.generated for j in jobs),
        prompt_tokens=sum(j.turn.prompt_len for j in jobs), cached_tokens=sum(j.cached for j in jobs),
        makespan_s=end - start, latency_s=tuple(sorted(j.finished - j.arrival for j in jobs)),
        ttft_s=tuple(sorted(j.first_token - j.arrival for j in jobs)), finish_s=tuple(j.finished for j in jobs),
        entropy=sum(entropy) / len(entropy), preemptions=sum(e.preemptions for e in engines),
        busy=sum(e.busy_s for e in engines) / len(engines) / (end - start), reasons=reasons)


def saturated_rate(cfg: SimConfig, users: int = 0) -> float:
    """Round-robin's capacity (requests/s): its completion rate with 8 closed-loop users per
    replica (enough to keep every engine stepping; more users deepen the queues and raise it
    only by batching bigger at a far worse latency), between the 20th and the 80th percentile
    completion (before, the engines fill; after, the last sessions drain)."""
    probe = replace(cfg, sessions=max(cfg.sessions // 2, 8 * cfg.replicas))
    result = simulate(probe, workload(probe, rate=1.0), "round_robin", users=users or 8 * cfg.replicas)
    finished = sorted(result.finish_s)
    a, b = len(finished) // 5, len(finished) * 4 // 5
    return (b - a) / (finished[b] - finished[a])


# -- report ------------------------------------------------------------------------------------
def table(results: Sequence[Result]) -> str:
    rows = ["| policy | req/s | out tok/s | P50 e2e s | P99 e2e s | P50 TTFT s | P99 TTFT s | prefix hit "
            "| load entropy | preemptions | engine busy |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(f"| {r.policy} | {r.rps:.2f} | {r.tps:.0f} | {r.pct(r.latency_s, 0.5):.1f} | "
                    f"{r.pct(r.latency_s, 0.99):.1f} | {r.pct(r.ttft_s, 0.5):.2f} | {r.pct(r.ttft_s, 0.99):.1f} | "
                    f"{r.hit_rate:.0%} | {r.entropy:.3f} | {r.preemptions} | {r.busy:.0%} |")
    return "\n".join(rows)


def verdict(results: Sequence[Result], target: str = "balancing+prefix", baseline: str = "round_robin") -> str:
    by = {r.policy: r for r in results}
    if target not in by or baseline not in by:
        return ""
    t, b = by[target], by[baseline]
    cut = 1 - t.pct(t.latency_s, 0.99) / b.pct(b.latency_s, 0.99)
    met = cut >= 0.30 and t.tps >= b.tps * 0.995      # "equal": within the 0.5% that the drain tail moves
    return (f"{target} vs {baseline}: P99 {cut:.0%} lower, throughput {t.tps / b.tps - 1:+.1%} "
            f"-> issue target (>= 30% lower P99 at equal or higher throughput) {'MET' if met else 'NOT met'}")


def plot(results: Sequence[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    markers = "osD^v<>ph*X"
    for i, r in enumerate(results):
        ax.scatter(r.tps, r.pct(r.latency_s, 0.99), marker=markers[i % len(markers)], s=80, label=r.policy)
    # The Pareto front: no other policy has both more throughput and a lower P99.
    front = sorted((r for r in results if not any(o.tps >= r.tps and o.pct(o.latency_s, 0.99) < r.pct(r.latency_s, 0.99)
                                                   for o in results if o is not r)), key=lambda r: r.tps)
    ax.plot([r.tps for r in front], [r.pct(r.latency_s, 0.99) for r in front], "k--", lw=0.8, label="Pareto front")
    ax.set_xlabel("throughput (output tokens/s, cluster)")
    ax.set_ylabel("P99 end-to-end latency (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: SimConfig, policies: Sequence[str]) -> tuple[float, list[Result]]:
    rate = cfg.rate or cfg.load * saturated_rate(cfg)
    sessions = workload(cfg, rate)
    return rate, [simulate(cfg, sessions, p) for p in policies]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a small smoke run (120 sessions)")
    p.add_argument("--sessions", type=int, default=SimConfig.sessions)
    p.add_argument("--load", type=float, default=SimConfig.load, help="fraction of round-robin's capacity")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s; overrides --load")
    p.add_argument("--prefixes", type=int, default=SimConfig.prefixes)
    p.add_argument("--policies", default=";".join(DEFAULT_POLICIES), help="';'-separated name[:field=value,...]")
    p.add_argument("--plot", default="bench/router_sim.png", help="PNG path; '' for none")
    a = p.parse_args(argv)
    cfg = SimConfig(seed=a.seed, sessions=120 if a.quick else a.sessions, load=a.load, rate=a.rate,
                    prefixes=a.prefixes)
    started = time.perf_counter()
    rate, results = run(cfg, a.policies.split(";"))
    prompt = sum(r.prompt_tokens for r in results[:1]) / results[0].requests
    title = (f"{cfg.replicas} engines, {results[0].requests} requests in {cfg.sessions} sessions,\n"
             f"{rate:.2f} req/s ({'set' if cfg.rate else f'{cfg.load:.0%} of round-robin capacity'}), "
             f"Zipf({cfg.zipf}) over {cfg.prefixes} prefixes, mean prompt {prompt:.0f} tokens, seed {cfg.seed}")
    print(title.replace("\n", " ") + "\n")
    print(table(results))
    print("\n" + verdict(results))
    if a.plot:
        try:
            plot(results, Path(a.plot), title)
            print(f"plot: {a.plot}")
        except ImportError:
            print("plot skipped: matplotlib is not installed (pip install -e '.[bench]')")
    print(f"simulated in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
