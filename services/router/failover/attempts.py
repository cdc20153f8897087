"""Attempts: one request's tries, replica after replica, as a state machine (dispatch.py drives it).

Pure: every method takes `now` and plain values and does no I/O; the dispatcher asks for the next
step, carries it out (tokenizes, relays an engine call) and reports how it went:

    attempts = Attempts(call, pool, policy.pick, route, streamed=len(stream.ids), max_tokens=...)
    try:
        while True:
            step = attempts.next(now, deadline_s)        # raises Saturated (Call.plan)
            Prepare(plan)      the plan is a fallback model's, nothing sent yet: tokenize for it, then
                               attempts.prepared(route, streamed)
            Try(replica, ...)  relay the engine call; attempts.replied(now) at each message; then one of
                               attempts.succeeded(now)
                               attempts.failed(failure, streamed, now) -> events to record
                               attempts.cancelled(now)              (the client left, a request error)
            Finished | FinishAtLength | Fail: the end (Fail: answer UNAVAILABLE with its message)
    finally:
        attempts.close(now)                              # Call.close: an odd ending gives its passes back

How a failed try ends, in this order: an isolated replica (level 1) is isolated first, whatever
follows; a stream that already holds `max_tokens` tokens ends there, at length (the engine died after
the last token, before its final message); a replica that refused before the first token
(RESOURCE_EXHAUSTED: busy, not failing) is left for another without a breaker judging it; any other
failure is a failed attempt, retried within the call's attempts and the shared retry budget (call.py).
A stream that holds tokens continues on their model; one that holds none may go down the fallback
chain, re-prepared for the new model.  At most 4 * max_attempts plans: a replica whose last probe
slot went between the plan and the start is planned again, but not forever.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from services.router.failover.call import Call
from services.router.failover.levels import Attempt, Plan
from services.router.policies import Decision, RouteRequest
from services.router.replicas import Replica

# The replicas a try may go to, given the model a stream continues on (None: any) and the replica ids
# the call failed on; and the balancing policy's pick among a plan's candidates.
Pool = Callable[[str | None, Collection[str]], Sequence[Replica]]
Pick = Callable[[Sequence[Replica], RouteRequest, float], Decision]


@dataclass(frozen=True)
class Failure:
    """How the engine ended a try (relay.EngineFailed, as data)."""
    replica_id: str
    reason: str          # what an isolation records: "failed: UNAVAILABLE: ...", "stalled: nothing for 5 s"
    error: str           # the whole message: "engine <replica id> <reason>"
    refused: bool        # RESOURCE_EXHAUSTED: its queue or grammar compiles were full
    isolate: bool        # the replica looks gone (level 1)


# -- what next() answers ------------------------------------------------------
@dataclass(frozen=True)
class Prepare:
    """Tokenize for `plan.model` (a fallback's, or the model's again), then `prepared`."""
    plan: Plan


@dataclass(frozen=True)
class Try:
    """Relay the engine call on `replica`.  reason: the metrics label (policy's, failover, fallback)."""
    replica: Replica
    plan: Plan
    reason: str
    failover_attempts: int       # the tries before this one


@dataclass(frozen=True)
class Finished:
    """The last try finished the stream."""
    plan: Plan
    first_token_s: float | None


@dataclass(frozen=True)
class FinishAtLength:
    """The engine died after the stream's last token, before its final message: end it there."""
    replica: Replica
    plan: Plan


@dataclass(frozen=True)
class Fail:
    """No try is left: the request fails with Unavailable(message)."""
    message: str


Next = Prepare | Try | Finished | FinishAtLength | Fail


# -- events: what failed() answers, for metrics, the console and the log -------------
@dataclass(frozen=True)
class Isolated:
    """Level 1: the replica was isolated."""
    replica_id: str
    reason: str


@dataclass(frozen=True)
class Busy:
    """The replica refused before the first token; another is tried (no breaker judged it)."""
    error: str


@dataclass(frozen=True)
class FailedOver:
    """Level 2: the try failed after `streamed` tokens; another replica is tried."""
    replica_id: str
    error: str
    streamed: int


Event = Isolated | Busy | FailedOver


@dataclass
class _Running:
    attempt: Attempt
    replica: Replica
    plan: Plan
    started: float
    first_token_s: float | None = None


class Attempts:
    """One request's tries, on its Call.  route: the prompt's routing request, for the requested model;
    streamed: the tokens the client stream holds already (a resumed stream's); max_tokens: the request's
    limit (0: none)."""

    def __init__(self, call: Call, pool: Pool, pick: Pick, route: RouteRequest, streamed: int = 0,
                 max_tokens: int = 0):
        self.call, self.pool, self.pick, self.route = call, pool, pick, route
        self.streamed, self.max_tokens = streamed, max_tokens
        self.model = call.model          # the model the stream's tokens come from (the route's)
        self.plans = 0
        self.max_plans = 4 * call.failover.config.max_attempts
        self._preparing: Plan | None = None      # Prepare answered, prepared() not yet called
        self._prepared: Plan | None = None       # ... called: the plan to start
        self._running: _Running | None = None
        self._end: Finished | FinishAtLength | Fail | None = None

    def next(self, now: float, deadline_s: float | None = None) -> Next:
        """The next step.  deadline_s: the seconds the request has left, if it has a deadline.
        Raises Saturated when no model of the chain has a replica that can take it."""
        if self._end is not None:
            return self._end
        if self._running is not None or self._preparing is not None:
            raise RuntimeError("the last step is not over: report how it went first")
        if self._prepared is not None:
            plan, self._prepared = self._prepared, None
            step = self._start(plan, now)
            if step is not None:
                return step
        while self.plans < self.max_plans:
            self.plans += 1
            pool = self.pool(self.model if self.streamed else None, self.call.failed_on)
            plan = self.call.plan(pool, now, deadline_s)
            if plan.model != self.model:          # nothing sent yet: the new model's own prompt first
                self.model, self._preparing = plan.model, plan
                return Prepare(plan)
            step = self._start(plan, now)
            if step is not None:
                return step
        self._end = Fail(f"no replica could be started for {self.call.model!r}; retry shortly")
        return self._end

    def _start(self, plan: Plan, now: float) -> Try | None:
        decision = self.pick(plan.candidates, self.route, now)
        attempt = self.call.start(decision.replica, now)
        if attempt is None:                       # its last probe slot went meanwhile: plan again
            return None
        reason = "fallback" if plan.degraded else "failover" if self.call.attempts > 1 else decision.reason
        self._running = _Running(attempt, decision.replica, plan, now)
        return Try(decision.replica, plan, reason, self.call.attempts - 1)

    def prepared(self, route: RouteRequest, streamed: int = 0) -> None:
        """The Prepare step's prompt is ready: its routing request and the tokens its stream holds."""
        if self._preparing is None:
            raise RuntimeError("nothing to prepare")
        self._prepared, self._preparing = self._preparing, None
        self.route, self.streamed = route, streamed

    def replied(self, now: float) -> None:
        """The running try relayed a message; the first one times the first token."""
        running = self._current()
        if running.first_token_s is None:
            running.first_token_s = now - running.started

    def succeeded(self, now: float) -> None:
        running = self._take()
        self.call.succeeded(running.attempt, now, running.first_token_s)
        self._end = Finished(running.plan, running.first_token_s)

    def failed(self, failure: Failure, streamed: int, now: float) -> list[Event]:
        """The engine ended the running try after the stream came to hold `streamed` tokens."""
        running = self._take()
        self.streamed = streamed
        events: list[Event] = []
        if failure.isolate:
            self.call.failover.isolate(failure.replica_id, now, failure.reason)
            events.append(Isolated(failure.replica_id, failure.reason))
        first_token_s = running.first_token_s
        if self.max_tokens and streamed >= self.max_tokens:
            self.call.succeeded(running.attempt, now, first_token_s)
            self._end = FinishAtLength(running.replica, running.plan)
        elif failure.refused and first_token_s is None:          # busy, not failing: no breaker
            if self.call.refused(running.attempt, now):
                events.append(Busy(failure.error))
            else:
                self._end = Fail(f"{failure.error}; every replica tried is busy")
        elif self.call.failed(running.attempt, now, first_token_s):
            events.append(FailedOver(running.replica.replica_id, failure.error, streamed))
        else:
            self._end = Fail(f"{failure.error}; no attempt or retry budget left for this request")
        return events

    def cancelled(self, now: float) -> None:
        """The running try ended for no replica's fault (the client left, a request error): the call is over."""
        self.call.cancelled(self._take().attempt, now)

    def close(self, now: float) -> None:
        self.call.close(now)

    def _current(self) -> _Running:
        if self._running is None:
            raise RuntimeError("no try is running")
        return self._running

    def _take(self) -> _Running:
        running, self._running = self._current(), None
        return running
