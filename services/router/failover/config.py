"""BreakerConfig, LatencyConfig and FailoverConfig: the knobs of the breakers and the three failover levels."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.router.failover.agreement import Evaluation
from services.router.failover.chain import FallbackChain


@dataclass(frozen=True)
class BreakerConfig:
    # Closed -> open, on the first of these to hold:
    failure_threshold: int = 5             # this many failures in a row
    error_rate: float = 0.05               # failures / outcomes in the window above this ...
    min_samples: int = 20                  # ... once the window holds at least this many outcomes
    p99_target_s: float | None = None      # P99 latency of the window's successes above this (None: off) ...
    latency_min_samples: int = 100         # ... once it holds this many: below ~100 a P99 is just the slowest one
    window_s: float = 30.0                 # the sliding window of outcomes the rates are judged over
    # Open -> half-open after open_s * backoff**level, at most max_open_s; `level` counts the
    # re-opens since the breaker last stayed closed for a whole window.
    open_s: float = 5.0
    backoff: float = 2.0
    max_open_s: float = 60.0
    # Half-open: this many probe requests are let through, in all; all succeed -> closed,
    # one fails -> open again (one level longer).
    probes: int = 3

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.min_samples < 1 or self.latency_min_samples < 1 or self.probes < 1:
            raise ValueError("failure_threshold, min_samples, latency_min_samples and probes must be at least 1")
        if not 0 <= self.error_rate < 1:
            raise ValueError("error_rate is a fraction in [0, 1)")
        if self.p99_target_s is not None and self.p99_target_s <= 0:
            raise ValueError("p99_target_s must be positive (or None: no latency breaker)")
        if self.window_s <= 0 or self.open_s <= 0 or self.max_open_s < self.open_s:
            raise ValueError("window_s and open_s must be positive and max_open_s >= open_s")
        if self.backoff < 1:
            raise ValueError("backoff must be >= 1")


@dataclass(frozen=True)
class LatencyConfig:
    """Level 3 by latency (latency.py): while a model's P95 time to first token stays over target_s,
    `share` of its interactive requests go to its fallback.  The router flags are --latency-degrade-*."""

    target_s: float | None = None          # the P95 time-to-first-token target; None: off
    window_s: float = 30.0                 # the sliding window the P95 is measured over
    min_samples: int = 20                  # fewer first tokens in the window: no verdict (not degrading)
    after_s: float = 10.0                  # over target at every look this long before degrading
    share: float = 0.3                     # of the model's interactive requests sent to the fallback meanwhile
    recover: float = 0.9                   # ... until the P95 is at or below recover * target_s

    def __post_init__(self) -> None:
        if self.target_s is not None and not (math.isfinite(self.target_s) and self.target_s > 0):
            raise ValueError(f"latency degradation: the P95 target (--latency-degrade-p95-ms) must be positive, "
                             f"not {self.target_s * 1000:g} ms")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"latency degradation: the window (--latency-degrade-window) must be positive seconds, "
                             f"not {self.window_s:g}")
        if self.min_samples < 1:
            raise ValueError(f"latency degradation: --latency-degrade-min-samples must be at least 1, "
                             f"not {self.min_samples}")
        if not (math.isfinite(self.after_s) and 0 <= self.after_s):
            raise ValueError(f"latency degradation: --latency-degrade-after must be >= 0 seconds, not {self.after_s:g}")
        if not 0 < self.share <= 1:
            raise ValueError(f"latency degradation: the share (--latency-degrade-share) is a fraction in (0, 1], "
                             f"not {self.share:g}")
        if not 0 < self.recover <= 1:
            raise ValueError(f"latency degradation: --latency-degrade-recover is a fraction of the target in "
                             f"(0, 1], not {self.recover:g}")


@dataclass(frozen=True)
class FailoverConfig:
    replica: BreakerConfig = field(default_factory=BreakerConfig)   # one breaker per replica, per attempt
    model: BreakerConfig = field(default_factory=BreakerConfig)     # one per model, per request (see call.py)
    # L3: model -> (next model, confidence of its answers relative to the model's), e.g.
    # {"smollm2-135m": ("smollm2-135m-int8", 0.8), "smollm2-135m-int8": ("tiny", 0.5)}.
    fallbacks: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    max_attempts: int = 3                  # attempts per request, the first included
    # The retry budget (budget.py): retries in any window_s <= ratio * requests + min_per_s * window_s.
    retry_ratio: float = 0.2
    retry_min_per_s: float = 1.0
    retry_window_s: float = 10.0
    # A replica is saturated, and not admitted, while Replica.queued exceeds this; None (the default):
    # while its queue is at the engine's own bound (GetInfo max_waiting, the engine's --max-waiting),
    # so the router sheds only what the engine would refuse.  Far above the affinity policies'
    # max_queued (4): that one steers, this one sheds.
    max_queued: int | None = None
    # Saturated.retry_after_s: the soonest recovery in whole seconds, clamped to this range.
    retry_after_min_s: int = 1
    retry_after_max_s: int = 30
    # ... and the guess when nothing has a known recovery time (unhealthy or isolated replicas).
    unknown_retry_after_s: float = 5.0
    # L3 by latency: a share of a model's interactive requests to its fallback while its P95 TTFT is high.
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    # The confidence of a degraded answer (agreement.py): measured agreement of the fallback with its
    # primary (these offline evaluations, plus shadow comparisons at run time) under a Beta prior centred
    # on the link's configured confidence and worth `prior_samples` comparisons.
    evaluations: tuple[Evaluation, ...] = ()
    prior_samples: float = 20.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.retry_ratio < 0 or self.retry_min_per_s < 0 or self.retry_window_s <= 0:
            raise ValueError("retry_ratio and retry_min_per_s must be >= 0 and retry_window_s positive")
        if self.max_queued is not None and self.max_queued < 0:
            raise ValueError("max_queued must be >= 0 (or None: no queue limit)")
        if not 1 <= self.retry_after_min_s <= self.retry_after_max_s:
            raise ValueError("need 1 <= retry_after_min_s <= retry_after_max_s")
        if not math.isfinite(self.unknown_retry_after_s) or self.unknown_retry_after_s <= 0:
            raise ValueError("unknown_retry_after_s must be positive")
        chain = FallbackChain(self.fallbacks)      # ValueError on a cycle or a confidence outside (0, 1]
        if not (math.isfinite(self.prior_samples) and self.prior_samples > 0):
            raise ValueError(f"prior_samples (--confidence-prior-samples) must be positive, not {self.prior_samples:g}")
        for e in self.evaluations:
            later = [step.model for step in chain.steps(e.primary)[1:]]
            if e.fallback not in later:
                raise ValueError(f"evaluation {e.primary} -> {e.fallback}: {e.fallback!r} is not in {e.primary!r}'s "
                                 f"fallback chain ({' -> '.join([e.primary, *later]) if later else 'no --fallback'})")
        if self.latency.target_s is not None and not self.fallbacks:
            raise ValueError("latency degradation (--latency-degrade-p95-ms) needs a fallback chain to degrade to "
                             "(--fallback MODEL=NEXT:CONFIDENCE)")
