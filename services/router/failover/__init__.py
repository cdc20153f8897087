"""Failover (docs/architecture.md, "Failover"): circuit breakers and the three levels, pure code
that takes `now`, does no I/O and is tested with a fake clock.

    breaker.py  Breaker: closed / open / half-open, on failures in a row, error rate, P99
    window.py   OutcomeWindow: the sliding window those rates are judged over
    budget.py   RetryBudget: retries shared by all requests, at most ~20% on top of them
    chain.py    FallbackChain: model -> next model, confidence multiplying along the chain
    agreement.py Agreement: a degraded answer's confidence from measured fallback/primary agreement
    latency.py  LatencyGuard: L3 by latency, a share of interactive requests to the fallback while P95 TTFT is high
    levels.py   Failover: L1 isolation, L2 admission, L3 plan over the chain; Saturated
    call.py     Call: one request's attempts, retries and model outcome
    attempts.py Attempts: a request's tries, a state machine (an outcome in, the next try out): dispatch.py's
    probes.py   ProbeVerdicts: a replica's health from its probes (isolated after misses in a row)
    config.py   BreakerConfig, LatencyConfig, FailoverConfig
"""

from services.router.failover.agreement import Agreement, Estimate, Evaluation, load_evaluations, posterior
from services.router.failover.attempts import Attempts
from services.router.failover.breaker import CAUSES, Breaker, BreakerState, Pass
from services.router.failover.budget import RetryBudget
from services.router.failover.call import Call
from services.router.failover.chain import FallbackChain, Step
from services.router.failover.config import BreakerConfig, FailoverConfig, LatencyConfig
from services.router.failover.latency import LatencyGuard, LatencyState, TtftWindow
from services.router.failover.levels import (
    EXCLUDED,
    ISOLATED,
    LATE,
    OPEN,
    PROBING,
    SATURATED,
    UNHEALTHY,
    Attempt,
    Failover,
    Plan,
    Saturated,
)
from services.router.failover.probes import ProbeVerdicts
from services.router.failover.window import OutcomeWindow, p99

__all__ = [
    "CAUSES", "EXCLUDED", "ISOLATED", "LATE", "OPEN", "PROBING", "SATURATED", "UNHEALTHY",
    "Agreement", "Attempt", "Attempts", "Breaker", "BreakerConfig", "BreakerState", "Call", "Estimate", "Evaluation",
    "Failover", "FailoverConfig", "FallbackChain", "LatencyConfig", "LatencyGuard", "LatencyState", "OutcomeWindow",
    "Pass", "Plan", "ProbeVerdicts", "RetryBudget", "Saturated", "Step", "TtftWindow", "load_evaluations", "p99",
    "posterior",
]
