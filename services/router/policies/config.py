"""PolicyConfig: the knobs of the balancing and affinity policies, in one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    region: str = "local"                  # the router's own region (requests with region "" mean this)
    entropy_window_s: float = 60.0         # load entropy covers the requests started this recently
    # Router-Balancing (docs/architecture.md, "Router", its Policies item):
    # score = p99_weight * (w_q * (1 - load_ratio) + w_m * (1 - mem_ratio))
    queue_weight: float = 0.6
    memory_weight: float = 0.4
    pressure_queue_weight: float = 0.3     # the weights once the candidates' mean mem_ratio > memory_pressure
    pressure_memory_weight: float = 0.7
    memory_pressure: float = 0.85
    p99_target_ms: float = 1000.0          # p99_weight = clamp(p99_target_ms / P99, p99_floor, 1)
    p99_floor: float = 0.1
    p99_min_samples: int = 20              # a P99 over fewer finished requests is noise: weight 1 instead
    engine_window_s: float = 10.0          # the engines' report window: LoadReport.qps * this = P99's samples
    latency_window_s: float = 10.0         # the router's own P99, used when a replica reports none
    # Affinity: a replica is overloaded (affinity gives way to balance) past any of these limits.
    max_queued: int = 4                    # Replica.queued: requests estimated waiting at the engine
    max_mem_ratio: float = 0.95            # Replica.mem_ratio: KV blocks held by running requests
    max_imbalance: int = 4                 # Replica.outstanding above the least loaded candidate's;
                                           # 4 was best of 2/4/8/16 in bench/router_sim.py
    vnodes: int = 128                      # virtual nodes per replica on the session hash ring
    prefix_capacity: int = 200_000         # block hashes remembered by prefix affinity (LRU)
    session_capacity: int = 100_000        # sessions whose replica is remembered (LRU)
    min_prefix_blocks: int = 4             # shorter matches (a shared chat-template header) don't count

    def __post_init__(self) -> None:
        for name in ("queue_weight", "memory_weight", "pressure_queue_weight", "pressure_memory_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0 < self.memory_pressure <= 1 or not 0 < self.max_mem_ratio <= 1:
            raise ValueError("memory_pressure and max_mem_ratio are fractions in (0, 1]")
        if self.p99_target_ms <= 0 or not 0 < self.p99_floor <= 1:
            raise ValueError("p99_target_ms must be positive and p99_floor in (0, 1]")
        if self.p99_min_samples < 1:
            raise ValueError("p99_min_samples must be at least 1")
        if self.entropy_window_s <= 0 or self.latency_window_s <= 0 or self.engine_window_s <= 0:
            raise ValueError("windows must be positive")
        if min(self.max_queued, self.max_imbalance) < 0:
            raise ValueError("max_queued and max_imbalance must be >= 0")
        if min(self.vnodes, self.prefix_capacity, self.min_prefix_blocks) < 1:
            raise ValueError("vnodes, prefix_capacity and min_prefix_blocks must be at least 1")
