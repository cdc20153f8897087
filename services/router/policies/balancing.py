"""Router-Balancing: score every candidate on queue depth, KV memory and P99, take the best.

    score = p99_weight * (w_q * (1 - load_ratio) + w_m * (1 - mem_ratio))

load_ratio = load / max(load over the candidates), load = outstanding / weight (weighted.py),
outstanding = in_flight + waiting (Replica.outstanding), weight the replica's discovery weight
(1 by default: load_ratio is then outstanding over the most outstanding).  Not the reported
qps: qps counts requests *finished* per second, a lagging signal that falls exactly when a
replica stalls behind a deep queue, so a qps ratio would send more work to the replica that
is furthest behind.  Outstanding work
sees the queue, and in_flight moves with every pick, so a burst between two load reports
spreads instead of landing on one replica.

mem_ratio = 1 - kv_blocks_free / kv_blocks_total (cached-but-evictable blocks are free).
(w_q, w_m) = (0.6, 0.4), or (0.3, 0.7) once the candidates' mean mem_ratio passes 0.85: when
memory is the scarce resource, a replica with free KV blocks is worth more than a short queue
(its next admission would otherwise preempt or stall).

p99_weight = clamp(p99_target_ms / P99 ms, floor 0.1, cap 1): slow replicas get less work but
never none, so their P99 can recover and be seen to.  P99 is the replica's report, or, when that
is missing, the router's own window over on_finish latencies; unknown means weight 1.  A P99 is
trusted only over p99_min_samples finished requests (a report's sample count is qps times the
engine's window): the P99 of three requests is the slowest of three, mostly a matter of how
many tokens each asked for, and bench/router_sim.py shows that feeding such noise back through
a 10x weight range herds work onto whichever replica was lucky and doubles P99.

A tenant's share: the load a request sees on a replica counts its own tenant's requests there
twice (load = (outstanding + the tenant's requests there) / weight; the tenant's count is the
engine's report or this router's in-flight count, whichever is higher).  With one tenant the
ratios are unchanged; with several, a tenant already heavy on one replica is steered to the
others while they have room, so the engines' fair scheduling (services/engine/core/fairness.py) has
less to arbitrate and the heavy tenant's work spreads instead of queuing behind itself.

Only candidates of weight > 0 are scored (weighted.py: weight 0 is a standby); equal best scores
(idle replicas) take turns by smooth weighted round-robin, so they too split by weight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from services.router.policies.config import PolicyConfig
from services.router.policies.policy import Decision, Policy, RouteRequest
from services.router.policies.weighted import SmoothWeighted, load_per_weight, serving, ties, weight_of
from services.router.replicas import Replica


class LatencyWindow:
    """Latencies of the requests finished in the last `window_s`, for a P99 the router saw itself."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()   # (finished at, latency ms)

    def add(self, latency_ms: float, now: float) -> None:
        self._samples.append((now, latency_ms))

    def p99(self, now: float, min_samples: int = 1) -> float:
        """0.0 with fewer than min_samples in the window; nearest rank, as the engines compute theirs."""
        while self._samples and self._samples[0][0] <= now - self.window_s:
            self._samples.popleft()
        if not self._samples or len(self._samples) < min_samples:
            return 0.0
        ordered = sorted(ms for _, ms in self._samples)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Balancing(Policy):
    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        super().__init__(self.config.entropy_window_s)
        self._latency: dict[str, LatencyWindow] = {}
        self.turns = SmoothWeighted()

    def weights(self, candidates: Sequence[Replica]) -> tuple[float, float]:
        """(w_q, w_m) for this pool: shifted toward memory under memory pressure."""
        c = self.config
        mean_mem = sum(r.mem_ratio for r in candidates) / len(candidates)
        if mean_mem > c.memory_pressure:
            return c.pressure_queue_weight, c.pressure_memory_weight
        return c.queue_weight, c.memory_weight

    def p99(self, replica: Replica, now: float) -> float:
        """The replica's P99 in ms if enough requests back it, else 0.0 (unknown)."""
        c = self.config
        if replica.p99_latency_ms > 0 and replica.qps * c.engine_window_s >= c.p99_min_samples - 1e-6:
            return replica.p99_latency_ms
        window = self._latency.get(replica.replica_id)
        return window.p99(now, c.p99_min_samples) if window else 0.0

    def p99_weight(self, replica: Replica, now: float) -> float:
        p99 = self.p99(replica, now)
        if p99 <= 0:
            return 1.0
        return min(1.0, max(self.config.p99_floor, self.config.p99_target_ms / p99))

    def scores(self, candidates: Sequence[Replica], now: float, tenant: str = "") -> list[float]:
        w_q, w_m = self.weights(candidates)
        loads = [load_per_weight(r) + r.tenant_load(tenant) / weight_of(r) for r in candidates]
        most = max(loads)
        out = []
        for r, load in zip(candidates, loads, strict=True):
            load_ratio = load / most if most else 0.0
            out.append(self.p99_weight(r, now) * (w_q * (1.0 - load_ratio) + w_m * (1.0 - r.mem_ratio)))
        return out

    def choose(self, candidates: Sequence[Replica], request: RouteRequest, now: float) -> Decision:
        pool = serving(candidates)
        scores = self.scores(pool, now, request.tenant)
        # Exact float equality is the common case (idle replicas score identically); the
        # tolerance only absorbs rounding between equal-looking states.
        tied = ties(pool, scores, max(scores))
        return Decision(tied[0] if len(tied) == 1 else self.turns.pick(tied), "balance")

    def on_finish(self, replica: Replica, request: RouteRequest, now: float, latency_s: float, ok: bool) -> None:
        window = self._latency.get(replica.replica_id)
        if window is None:
            window = self._latency[replica.replica_id] = LatencyWindow(self.config.latency_window_s)
        window.add(latency_s * 1000.0, now)
