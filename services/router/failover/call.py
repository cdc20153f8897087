"""Call: one client request's way through failover: its attempts, retries and model outcomes.

For each request (attempts.py's Attempts does this, and dispatch.py drives it):

    call = Call(failover, model, now, interactive)     # counts the request for the retry budget
    while True:
        plan = call.plan(replicas, now)                # raises Saturated (UNAVAILABLE + retry-after)
        replica = policy.pick(plan.candidates, route, now).replica
        attempt = call.start(replica, now)
        if attempt is None:
            continue                                   # its last probe slot went meanwhile: plan again
        ...relay; then exactly one of:
        call.succeeded(attempt, now, ttft)             # done
        call.cancelled(attempt, now)                   # the client went away: no outcome
        if not call.refused(attempt, now): raise ...   # RESOURCE_EXHAUSTED before a token: no outcome
        if not call.failed(attempt, now): raise ...    # False: attempts or retry budget spent
    ...and, in a `finally`, call.close(now): whatever ended oddly gives its passes back.

Replica breakers judge attempts; model breakers judge requests.  A request that failed on one
replica and succeeded on the retry was served by its model, so the model breaker counts a
success: one bad replica is the replica breaker's business (and opening the model breaker for
it would send all of a healthy model's traffic down the fallback chain).  Each model the call
tried gets one outcome when the call ends: ok if the call was served there, failed otherwise.

An interactive call (not batch priority, not a shadow mirror) feeds and obeys level 3 by latency
(latency.py): its attempts' times to first token are measured for their model, and whether it
prefers the fallback is decided once, when it starts, so its retries do not draw again.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.failover.breaker import Pass
from services.router.failover.levels import Attempt, Failover, Plan, Saturated
from services.router.replicas import Replica


class Call:
    def __init__(self, failover: Failover, model: str, now: float, interactive: bool = True):
        self.failover, self.model, self.started = failover, model, now
        self.interactive = interactive
        self.latency_fallback = interactive and failover.latency_fallback(model, now)
        self.attempts = 0                    # started on a replica, the first included
        self.failed_on: set[str] = set()     # replica ids: never planned again for this call
        self.done = False
        self._model_passes: dict[str, Pass] = {}
        self._tried_models: set[str] = set()
        self._attempt: Attempt | None = None    # started and not yet ended
        failover.note_request(now)

    def plan(self, replicas: Sequence[Replica], now: float, deadline_s: float | None = None) -> Plan:
        """Failover.plan for this call: the replicas it failed on are excluded, and it takes
        the pass of the planned model's breaker (a probe, when that one is half-open).
        deadline_s: the seconds the request has left, if it has a deadline."""
        if self.done:
            raise RuntimeError("the call is over: no more attempts")
        try:
            plan = self.failover.plan(self.model, replicas, now, self.failed_on, self._model_passes, deadline_s,
                                      self.latency_fallback)
        except Saturated:
            self._finish(now)
            raise
        breaker = self.failover.model_breaker(plan.model)
        held = self._model_passes.get(plan.model)
        if held is None or not breaker.current(held):
            granted = breaker.acquire(now)
            if granted is None:      # plan() just saw it allow at this `now`: cannot happen
                raise RuntimeError(f"model breaker of {plan.model!r} refused a pass plan() counted on")
            self._model_passes[plan.model] = granted
        return plan

    def start(self, replica: Replica, now: float) -> Attempt | None:
        """The attempt on `replica` (from the last plan's candidates), or None when its breaker
        has no pass left (half-open, probes taken since the plan): plan again."""
        if self._attempt is not None:
            raise RuntimeError("one attempt at a time: end the last one first")
        attempt = self.failover.start(replica, now)
        if attempt is not None:
            self.attempts += 1
            self._attempt = attempt
        return attempt

    def succeeded(self, attempt: Attempt, now: float, latency_s: float | None = None) -> None:
        """latency_s: the attempt's time to first token, what the P99 targets judge."""
        self._attempt = None
        self._tried_models.add(attempt.model)
        self.failover.record(attempt, now, True, latency_s)
        self._first_token(attempt, now, latency_s)
        self._finish(now, served_on=attempt.model, latency_s=latency_s)

    def failed(self, attempt: Attempt, now: float, latency_s: float | None = None) -> bool:
        """The attempt failed (engine error, stall, death, before or after its first token).
        True: retry, on a new plan; False: the call is over, answer the error."""
        self._attempt = None
        self._tried_models.add(attempt.model)
        self.failover.record(attempt, now, False, latency_s)
        self._first_token(attempt, now, latency_s)
        self.failed_on.add(attempt.replica_id)
        # Attempts first, so a call that may not retry anyway leaves the shared budget alone.
        if self.attempts < self.failover.config.max_attempts and self.failover.retry_allowed(now):
            return True
        self._finish(now)
        return False

    def refused(self, attempt: Attempt, now: float) -> bool:
        """The replica refused the request before starting it (RESOURCE_EXHAUSTED: its queue or grammar
        compiles full): back-pressure, not a failure.  Neither breaker judges it; the replica is not planned
        again for this call.  True: try another (the retry budget is not spent); False: attempts are spent."""
        self._attempt = None
        self.failover.release(attempt)
        self.failed_on.add(attempt.replica_id)
        if self.attempts < self.failover.config.max_attempts:
            return True
        self._finish(now)
        return False

    def _first_token(self, attempt: Attempt, now: float, latency_s: float | None) -> None:
        """A first token that came (the stream may have died later) is a sample of its model's TTFT."""
        if self.interactive and latency_s is not None:
            self.failover.note_first_token(attempt.model, now, latency_s)

    def cancelled(self, attempt: Attempt | None, now: float) -> None:
        """The client went away (or the call ends for a reason that is no replica's fault):
        passes go back unjudged."""
        self._attempt = None
        if attempt is not None:
            self.failover.release(attempt)
        self._finish(now, judge=False)

    def close(self, now: float) -> None:
        """For a `finally`: a call that ended above is untouched; otherwise (an exception that is
        no replica's fault, or a retry the server chose not to make) it ends like a cancellation,
        so no half-open probe slot stays taken for good."""
        if not self.done or self._attempt is not None:
            self.cancelled(self._attempt, now)

    def _finish(self, now: float, served_on: str = "", latency_s: float | None = None, judge: bool = True) -> None:
        if self.done:
            return
        self.done = True
        for model, granted in self._model_passes.items():
            breaker = self.failover.model_breaker(model)
            if judge and model == served_on:
                breaker.record(granted, now, True, latency_s)
            elif judge and model in self._tried_models:
                breaker.record(granted, now, False)
            else:
                breaker.release(granted)     # planned there, never attempted: nothing to judge
        self._model_passes.clear()
