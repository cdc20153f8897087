"""What the engine's loop measures, kept out of it: each request's phase timings and each step's figures.

The step thread writes (one `step()` block per step, `finished()` as requests end); the server
reads: the step figures after every step (for Prometheus), a request's timings once it is over
(for its trace spans).  What the server's streams saw in the last seconds (requests finished, tokens
generated) is kept in a RecentLoad for its load reports.  No torch here: the metrics import it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from services.engine.core.fairness import StepTimes

if TYPE_CHECKING:
    from services.engine.core.request import StepOutput
    from services.engine.core.scheduler import Batch

# Timings kept for requests whose server never collects them (in-process callers): the oldest go first.
MAX_TIMINGS = 4096
# Tenants whose served tokens are counted by name (metrics, load reports); later ones count as OTHER.
MAX_TENANTS = 256
OTHER = "(other)"


class TenantLoad(NamedTuple):
    """One tenant's requests in the engine after a step, and the tokens computed for it since start."""

    tenant: str             # "": the common tenant (requests that name none)
    running: int            # holding KV blocks
    waiting: int
    tokens: int


@dataclass
class Timing:
    """Wall-clock readings (time.time_ns()) of one request's phases, for its trace spans; 0: not yet.

    queue: arrival -> scheduled; prefill: scheduled -> first_token; decode: first_token -> finished."""

    arrival_ns: int = 0
    scheduled_ns: int = 0          # the first step that ran any of its tokens began
    first_token_ns: int = 0        # the step that sampled its first token ended
    finished_ns: int = 0


class EngineStats:
    def __init__(self, step_times: StepTimes | None = None) -> None:
        self.step_times = step_times or StepTimes()     # decode steps' times by rows (the scheduler's row cap)
        self.capped = 0                 # steps that left requests out for a light tenant's share, since start
        self.last_step_s = 0.0          # the last step that ran the model: its duration,
        self.last_step_tokens = 0       # tokens computed and sequences run (0 after an idle step)
        self.last_batch_size = 0
        self.preemptions = 0            # since start
        self.draft_tokens = 0           # speculation, since start: draft tokens verified,
        self.accepted_tokens = 0        # and of them, accepted
        self.draft_speedup = 0.0        # a draft model's last drafted step: its tokens a second over a plain step's
        self.paused = 0                 # running requests left out of a step by fair scheduling, since start
        self.interrupted = 0            # steps of batch-class rows given up for an interactive arrival
        self.tenant_tokens: dict[str, int] = {}     # tokens computed per tenant since start (MAX_TENANTS names)
        self.tenants: tuple[TenantLoad, ...] = ()   # after the last step, busiest first (a new tuple each step)
        self._timings: dict[str, Timing] = {}
        self._lock = threading.Lock()

    def arrived(self, request_id: str) -> None:
        with self._lock:
            self._timings[request_id] = Timing(arrival_ns=time.time_ns())
            if len(self._timings) > MAX_TIMINGS:
                del self._timings[next(iter(self._timings))]

    def finished(self, request_id: str) -> None:
        timing = self._timings.get(request_id)
        if timing is not None:
            timing.finished_ns = time.time_ns()

    def observe_tenants(self, tenants: dict[str, tuple[int, int]]) -> None:
        """After a step: each tenant's (running, waiting) requests, kept as `tenants` with their tokens."""
        served = self.tenant_tokens
        self.tenants = tuple(sorted((TenantLoad(t, r, w, served.get(t, 0)) for t, (r, w) in tenants.items()),
                                    key=lambda load: (-load.running - load.waiting, load.tenant)))

    def _count_tokens(self, batch: Batch) -> None:
        served = self.tenant_tokens
        for chunk in batch.chunks:
            name = chunk.request.tenant
            if name not in served and len(served) >= MAX_TENANTS:
                name = OTHER
            served[name] = served.get(name, 0) + chunk.num_tokens

    def gave_way(self) -> None:
        """A step of batch-class rows was given up for an interactive arrival (not run: no figures)."""
        self.interrupted += 1

    def drafted(self, drafted: int, accepted: int) -> None:
        self.draft_tokens += drafted
        self.accepted_tokens += accepted

    def pop_timing(self, request_id: str) -> Timing | None:
        """The request's phase timings (once: the entry is dropped)."""
        with self._lock:
            return self._timings.pop(request_id, None)

    @contextmanager
    def step(self, batch: Batch) -> Iterator[None]:
        """Around one step's run of `batch`: its figures, its requests' phase stamps and its tokens per
        tenant, recorded when it succeeds (a step that raises leaves the last figures as they were)."""
        self.preemptions += len(batch.preempted)
        self.paused += batch.paused
        self.capped += batch.capped
        self.last_step_tokens = self.last_batch_size = 0
        started, started_ns = time.perf_counter(), time.time_ns()
        yield
        if not batch.chunks:
            return
        self.last_step_s = time.perf_counter() - started
        if all(c.num_tokens == 1 for c in batch.chunks):
            self.step_times.record(len(batch.chunks), self.last_step_s)
        self._count_tokens(batch)
        self.last_step_tokens = batch.num_tokens
        self.last_batch_size = len(batch.chunks)
        ended_ns = time.time_ns()
        for chunk in batch.chunks:
            timing = self._timings.get(chunk.request.request_id)
            if timing is None:
                continue
            if not timing.scheduled_ns:
                timing.scheduled_ns = started_ns
            if chunk.sample and not timing.first_token_ns:
                timing.first_token_ns = ended_ns


class LoadFigures(NamedTuple):
    """The last window's figures, as a load report carries them."""

    qps: float                  # requests finished a second
    p50_latency_ms: float       # their latency (a Generate call's start to its last message)
    p99_latency_ms: float
    tokens_per_second: float    # tokens generated


class RecentLoad:
    """Requests finished and tokens generated in the last `window_s` seconds (time.monotonic() readings),
    for load reports: the last 512 requests and the last 4,096 outputs, at most."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._finished: deque[tuple[float, float]] = deque(maxlen=512)    # (end time, latency s)
        self._tokens: deque[tuple[float, int]] = deque(maxlen=4096)       # (step end, tokens of one output)

    def generated(self, now: float, outputs: Sequence[StepOutput]) -> None:
        """A step's outputs, delivered at `now`."""
        for out in outputs:
            self._tokens.append((now, len(out.new_ids)))

    def finished(self, now: float, latency_s: float) -> None:
        self._finished.append((now, latency_s))

    def figures(self, now: float) -> LoadFigures:
        window = self.window_s
        latencies = sorted(lat for t, lat in self._finished if now - t < window)
        tokens = sum(n for t, n in self._tokens if now - t < window)

        def pct(p: float) -> float:
            return 1000.0 * latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else 0.0

        return LoadFigures(len(latencies) / window, pct(0.5), pct(0.99), tokens / window)
