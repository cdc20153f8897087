"""RouterConfig: where the tokenizer, cache and engines are, and how to choose among engines."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.discovery import Endpoint
from mesh.ratelimit import Rate
from services.router.failover import BreakerConfig, Evaluation, FailoverConfig, LatencyConfig
from services.router.policies import POLICIES


@dataclass(frozen=True)
class RouterConfig:
    tokenizer: str                         # host:port; several replicas: comma-separated
    engines: tuple[Endpoint, ...]          # the static registry's engines
    cache: str = ""                        # host:port; empty: no session store
    replica_id: str = "router-0"
    host: str = "127.0.0.1"
    port: int = 50051
    region: str = "local"
    policy: str = "balancing+region+prefix+session"
    default_model: str = "smollm2-135m"
    default_versions: tuple[tuple[str, str], ...] = ()   # (model, version) routed to unless pinned/canary
    probe_interval_s: float = 1.0          # health/info probes of every engine
    load_interval_ms: int = 250            # engines' load reports (WatchLoad)
    discovery: str = "static"              # static: `engines`; consul: the agent at CONSUL_HTTP_ADDR
    advertise: str = ""                # HOST[:PORT] registered in discovery; "": the bind host
    tls_dir: str = ""                  # mesh mutual TLS (ca.crt, tls.crt, tls.key); "": plaintext
    metrics_port: int = 0                  # Prometheus /metrics; 0: off
    first_token_timeout_s: float = 120.0   # an engine silent this long before its first token has failed
    stall_timeout_s: float = 10.0          # ...or this long between tokens: the stream moves elsewhere
    max_attempts: int = 3                  # replicas tried per request, mid-stream failovers included
    unhealthy_after: int = 2               # health probes missed in a row before a replica is isolated
    fallbacks: tuple[tuple[str, str, float], ...] = ()   # (model, next model, confidence): level-3 chain
    # Level 3 by latency (failover/latency.py): while a model's P95 time to first token (interactive
    # requests, over latency_degrade_window_s, at least latency_degrade_min_samples) stays over
    # latency_degrade_p95_ms for latency_degrade_after_s, latency_degrade_share of its interactive
    # requests go to its fallback, until the P95 is at or below latency_degrade_recover x the target.
    latency_degrade_p95_ms: float = 0.0    # 0: off
    latency_degrade_window_s: float = 30.0
    latency_degrade_min_samples: int = 20
    latency_degrade_after_s: float = 10.0
    latency_degrade_share: float = 0.3
    latency_degrade_recover: float = 0.9
    # A degraded answer's confidence (failover/agreement.py): measured agreement of fallback and primary
    # from offline evaluations (--fallback-eval) and from mirroring this share of the primary's requests to
    # its fallback (shadow.py), with the --fallback confidence as a prior worth confidence_prior_samples.
    fallback_evals: tuple[Evaluation, ...] = ()
    fallback_shadow_share: float = 0.0
    confidence_prior_samples: float = 20.0
    p99_target_ms: float = 0.0             # a replica whose P99 time to first token exceeds it is opened; 0: off
    max_queued: int = 0                    # shed a replica past this many queued; 0: at the engine's own bound
    prefix_sharing: str = "tenant"         # cached prompt blocks shared within a tenant, or "global": by all
    # Not ready until this many engines have been healthy at once; 0: every static engine (1 with Consul).
    expect_engines: int = 0
    # Native gRPC callers (not the edge) meet the edge's rules (services/router/callers.py):
    api_key_digests: tuple[bytes, ...] = ()     # INFERMESH_API_KEYS; empty: no key asked
    admin_key_digests: tuple[bytes, ...] = ()   # INFERMESH_ADMIN_KEYS: SetModelRouting from a client certificate
    rate_limit: Rate | None = None              # requests per API key (INFERMESH_RATE_LIMIT)
    token_limit: Rate | None = None             # prompt + completion tokens per API key (INFERMESH_TOKEN_LIMIT)
    auth_failure_limit: Rate | None = None      # failed keys per peer address

    def __post_init__(self) -> None:
        if self.prefix_sharing not in ("tenant", "global"):
            raise ValueError(f"prefix_sharing {self.prefix_sharing!r} is not 'tenant' or 'global'")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.discovery == "static" and not self.engines:
            raise ValueError("the router needs at least one engine (--engine ID=HOST:PORT) or --discovery consul")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if self.probe_interval_s <= 0:
            raise ValueError("probe_interval_s must be positive")
        if self.stall_timeout_s <= 0 or self.first_token_timeout_s <= 0 or self.max_attempts < 1:
            raise ValueError("stall/first-token timeouts must be positive and max_attempts at least 1")
        self.failover()                    # raises on a fallback cycle, a bad confidence or latency knob
        if not 0 <= self.fallback_shadow_share <= 1:
            raise ValueError(f"--fallback-shadow-share is a fraction in [0, 1], not {self.fallback_shadow_share:g}")
        if self.fallback_shadow_share and not self.fallbacks:
            raise ValueError("--fallback-shadow-share mirrors requests to a fallback model: it needs --fallback")
        if self.expect_engines < 0:
            raise ValueError("expect_engines must be 0 or more")

    @property
    def expected_engines(self) -> int:
        """Engines that must have been healthy at once before the router first reports ready."""
        return self.expect_engines or (len(self.engines) if self.discovery == "static" else 1)

    def failover(self) -> FailoverConfig:
        """The failover knobs these flags set (the rest keep FailoverConfig's defaults)."""
        p99_target_s = self.p99_target_ms / 1000 if self.p99_target_ms else None
        latency = LatencyConfig(self.latency_degrade_p95_ms / 1000 if self.latency_degrade_p95_ms else None,
                                self.latency_degrade_window_s, self.latency_degrade_min_samples,
                                self.latency_degrade_after_s, self.latency_degrade_share, self.latency_degrade_recover)
        return FailoverConfig(fallbacks={m: (n, c) for m, n, c in self.fallbacks}, max_attempts=self.max_attempts,
                              max_queued=self.max_queued or None,
                              replica=BreakerConfig(p99_target_s=p99_target_s), latency=latency,
                              evaluations=self.fallback_evals, prior_samples=self.confidence_prior_samples)
