"""Failover: the three levels, as one object the router consults.  Pure: takes `now`, no I/O.

    L1  a replica that is unhealthy (its health check fails) or isolated (the router saw its
        process go or its device fail) is not admitted; it comes back with a health check
        that passes after the isolation, and when its breaker allows.
    L2  a replica whose breaker is open is not admitted (its requests are retried elsewhere,
        call.py), nor is one whose breaker is half-open with every probe out, nor one whose
        engine queue is at its bound (the engine's max_waiting, or `max_queued`): saturated,
        nor, for a request with a deadline, one whose queue would make it wait longer than
        that (queued requests / the requests it finishes per second): late.
    L3  when the requested model's breaker refuses, or none of its replicas is admitted, the
        request goes to the next model of its fallback chain that has one: degraded, with
        the confidence measured for it (agreement.py; the chain's configured confidence when
        nothing is measured).  When no model of the chain has one: Saturated, with a
        Retry-After from the soonest recovery.  And by latency (latency.py): while the model's
        P95 time to first token stays over target, a share of its interactive requests prefer
        its first fallback (they stay on the model when the fallback has no admitted replica).

`plan` only reads; passes are taken by `start` (replica breakers) and by Call (model
breakers), and the dispatcher uses a Call per request (call.py) rather than these directly.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from mesh.errors import Unavailable
from services.router.failover.agreement import Agreement
from services.router.failover.breaker import Breaker, BreakerState, Pass
from services.router.failover.budget import RetryBudget
from services.router.failover.chain import FallbackChain
from services.router.failover.config import FailoverConfig
from services.router.failover.latency import LatencyGuard
from services.router.replicas import Replica

# Why a replica is not admitted (refusal's answers; metrics labels), in the order checked.
UNHEALTHY, ISOLATED, OPEN, PROBING, SATURATED, LATE, EXCLUDED = (
    "unhealthy", "isolated", "open", "probing", "saturated", "late", "excluded")


class Saturated(Unavailable):
    """No model of the request's chain has an admitted replica.  The server answers
    UNAVAILABLE (this is a mesh.errors.Unavailable) with `retry-after: retry_after_s`."""

    def __init__(self, model: str, retry_after_s: int, detail: str):
        super().__init__(f"no replica can take a request for {model!r} now ({detail}); "
                         f"retry after {retry_after_s} s")
        self.model, self.retry_after_s, self.detail = model, retry_after_s, detail


class Plan(NamedTuple):
    model: str                   # where the request goes: the requested model or a fallback
    candidates: list[Replica]    # its admitted replicas, in the order given: the policy picks one
    degraded: bool               # model is a fallback
    confidence: float            # 1.0, or the measured confidence of model's answers (agreement.py)
    why: str = ""                # why the models before it were passed over ("" when not degraded)
    degraded_by: str = ""        # "capacity" (no admitted replica, breaker open) | "latency" | "" (not degraded)
    confidence_source: str = ""  # configured | offline | shadow | "+"-joined (agreement.py); "" when not degraded


class Attempt(NamedTuple):
    """One try of a request on one replica; ends in Failover.record or Failover.release."""

    replica_id: str
    model: str
    started: float
    granted: Pass


class Failover:
    def __init__(self, config: FailoverConfig | None = None):
        self.config = config or FailoverConfig()
        self.chain = FallbackChain(self.config.fallbacks)
        c = self.config
        self.budget = RetryBudget(c.retry_ratio, c.retry_min_per_s, c.retry_window_s)
        self.agreement = Agreement(self.chain, c.evaluations, c.prior_samples)
        self.latency = LatencyGuard(c.latency)
        self._replicas: dict[str, Breaker] = {}
        self._models: dict[str, Breaker] = {}
        self._isolated: dict[str, tuple[float, str]] = {}     # replica id -> (since, reason)

    # -- breakers and their state, for metrics -----------------------------------------
    def replica_breaker(self, replica_id: str) -> Breaker:
        breaker = self._replicas.get(replica_id)
        if breaker is None:
            breaker = self._replicas[replica_id] = Breaker(self.config.replica)
        return breaker

    def model_breaker(self, model: str) -> Breaker:
        breaker = self._models.get(model)
        if breaker is None:
            breaker = self._models[model] = Breaker(self.config.model)
        return breaker

    def states(self, now: float) -> dict[str, BreakerState]:
        """replica id -> its breaker's state (replicas never attempted are closed and absent)."""
        return {rid: b.state(now) for rid, b in sorted(self._replicas.items())}

    def model_states(self, now: float) -> dict[str, BreakerState]:
        return {model: b.state(now) for model, b in sorted(self._models.items())}

    def forget(self, replica_id: str) -> None:
        """The replica left discovery for good (a replica that comes back starts afresh)."""
        self._replicas.pop(replica_id, None)
        self._isolated.pop(replica_id, None)

    # -- L1 ----------------------------------------------------------------------------
    def isolate(self, replica_id: str, now: float, reason: str) -> None:
        """Stop admitting the replica at once: its process is gone or its device failed, seen
        before the next health check could tell."""
        self._isolated[replica_id] = (now, reason)

    def health_checked(self, replica_id: str, healthy: bool, checked_at: float) -> None:
        """A health check sent at `checked_at` answered.  Only one sent after the isolation
        can end it: an answer already on its way may predate the failure."""
        isolated = self._isolated.get(replica_id)
        if healthy and isolated is not None and checked_at > isolated[0]:
            del self._isolated[replica_id]

    def isolation(self, replica_id: str) -> str | None:
        """Why the replica is isolated, or None."""
        isolated = self._isolated.get(replica_id)
        return None if isolated is None else isolated[1]

    # -- L1 + L2: admission ------------------------------------------------------------
    def refusal(self, replica: Replica, now: float, exclude: Collection[str] = frozenset(),
                deadline_s: float | None = None) -> str:
        """Why `replica` is not admitted now (UNHEALTHY ... EXCLUDED), or "" when it is.
        deadline_s: the seconds the request has left, if it has a deadline."""
        if not replica.healthy:
            return UNHEALTHY
        if replica.replica_id in self._isolated:
            return ISOLATED
        breaker = self._replicas.get(replica.replica_id)
        if breaker is not None and not breaker.allows(now):
            return OPEN if breaker.state(now) is BreakerState.OPEN else PROBING
        if self._saturated(replica):
            return SATURATED
        if deadline_s is not None and self.queue_wait_s(replica) > deadline_s:
            return LATE
        if replica.replica_id in exclude:
            return EXCLUDED
        return ""

    @staticmethod
    def queue_wait_s(replica: Replica) -> float:
        """The expected wait in the replica's engine queue: the requests queued there over the requests
        it finishes per second (its load report's window); 0 while it reports none finished."""
        return replica.queued / replica.qps if replica.qps > 0 else 0.0

    def _saturated(self, replica: Replica) -> bool:
        if self.config.max_queued is not None:
            return replica.queued > self.config.max_queued
        return replica.max_waiting > 0 and replica.queued >= replica.max_waiting

    # -- L3: the plan ------------------------------------------------------------------
    def latency_fallback(self, model: str, now: float) -> bool:
        """Whether this interactive request for `model` should prefer its fallback (latency.py)."""
        return len(self.chain.steps(model)) > 1 and self.latency.take(model, now)

    def plan(self, model: str, replicas: Sequence[Replica], now: float, exclude: Collection[str] = frozenset(),
             held: Mapping[str, Pass] | None = None, deadline_s: float | None = None,
             prefer_fallback: bool = False) -> Plan:
        """The admitted replicas of the first model of `model`'s chain that has any; raises
        Saturated when none has.  exclude: replica ids the request already failed on.
        held: model -> the model-breaker pass the request holds (Call's), which admits the
        model even while its half-open breaker has every probe out.  deadline_s: the seconds the
        request has left (a replica whose queue would outlast them is refused as LATE).
        prefer_fallback: latency degradation chose this request (latency_fallback): the chain's
        second model is tried first, then the model, then the rest of the chain."""
        held = held or {}
        passed_over: list[str] = []
        recoveries: list[float] = []
        order = list(enumerate(self.chain.steps(model)))
        if prefer_fallback and len(order) > 1:
            order[0], order[1] = order[1], order[0]
        for index, step in order:
            breaker = self._models.get(step.model)
            holds = breaker is not None and step.model in held and breaker.current(held[step.model])
            if breaker is not None and not breaker.allows(now) and not holds:
                passed_over.append(f"{step.model}: model breaker {breaker.state(now)} ({breaker.reason})")
                recoveries.append(self._recovery(breaker, now))
                continue
            refused: Counter[str] = Counter()
            candidates = []
            waits: list[float] = []
            for r in replicas:
                if r.model != step.model:
                    continue
                why = self.refusal(r, now, exclude, deadline_s)
                if why:
                    refused[why] += 1
                    recoveries.append(self._replica_recovery(r, why, now, deadline_s))
                    if why == LATE:
                        waits.append(self.queue_wait_s(r))
                else:
                    candidates.append(r)
            if candidates:
                return self._plan(model, index, candidates, passed_over, prefer_fallback, now)
            counts = ", ".join(f"{n} {why}" for why, n in sorted(refused.items())) or "no replica"
            if waits:
                counts += (f" (queue wait ~{min(waits):.0f} s at the shortest, beyond the request's deadline of "
                           f"{deadline_s:.0f} s)")
            passed_over.append(f"{step.model}: {counts}")
        raise Saturated(model, self._retry_after(recoveries), "; ".join(passed_over))

    def _plan(self, model: str, index: int, candidates: list[Replica], passed_over: list[str],
              prefer_fallback: bool, now: float) -> Plan:
        """The plan for step `index` of `model`'s chain, whose admitted replicas are `candidates`."""
        if index == 0:
            return Plan(model, candidates, False, 1.0)
        estimate = self.agreement.estimate(model, index)
        step = self.chain.steps(model)[index]
        if prefer_fallback and index == 1:
            return Plan(step.model, candidates, True, estimate.confidence, self.latency.reason(model, now),
                        "latency", estimate.source)
        return Plan(step.model, candidates, True, estimate.confidence, "; ".join(passed_over), "capacity",
                    estimate.source)

    def _recovery(self, breaker: Breaker, now: float) -> float:
        """Seconds until `breaker` may admit again: to half-open, or a moment while probing."""
        half_open_at = breaker.half_open_at
        return 0.0 if half_open_at is None else max(half_open_at - now, 0.0)

    def _replica_recovery(self, replica: Replica, why: str, now: float, deadline_s: float | None = None) -> float:
        if why == LATE and deadline_s is not None:
            return self.queue_wait_s(replica) - deadline_s      # until the queue has drained that much
        if why in (UNHEALTHY, ISOLATED):
            return self.config.unknown_retry_after_s     # the health checks will tell; no clock says when
        if why in (OPEN, PROBING):
            return self._recovery(self.replica_breaker(replica.replica_id), now)
        return 0.0          # saturated: queues drain; excluded: another request may use it now

    def _retry_after(self, recoveries: list[float]) -> int:
        c = self.config
        soonest = min(recoveries, default=c.unknown_retry_after_s)
        return min(max(math.ceil(soonest), c.retry_after_min_s), c.retry_after_max_s)

    # -- attempts ----------------------------------------------------------------------
    def start(self, replica: Replica, now: float) -> Attempt | None:
        """Take the replica breaker's pass for one attempt, or None when it has none left
        (a half-open replica whose probes went to other requests since the plan)."""
        granted = self.replica_breaker(replica.replica_id).acquire(now)
        if granted is None:
            return None
        return Attempt(replica.replica_id, replica.model, now, granted)

    def record(self, attempt: Attempt, now: float, ok: bool, latency_s: float | None = None) -> None:
        """The attempt's outcome: ok=False for an engine error, a stall or a death; a client
        cancellation is no outcome (release instead)."""
        breaker = self._replicas.get(attempt.replica_id)
        if breaker is not None:        # None: the replica was forgotten meanwhile
            breaker.record(attempt.granted, now, ok, latency_s)

    def release(self, attempt: Attempt) -> None:
        breaker = self._replicas.get(attempt.replica_id)
        if breaker is not None:
            breaker.release(attempt.granted)

    def note_request(self, now: float) -> None:
        self.budget.note_request(now)

    def note_first_token(self, model: str, now: float, ttft_s: float) -> None:
        """An interactive attempt on `model` got its first token after `ttft_s` (latency.py)."""
        self.latency.record(model, now, ttft_s)

    def retry_allowed(self, now: float) -> bool:
        """Take one retry from the shared budget: True when allowed."""
        return self.budget.try_spend(now)
