"""Breaker: a circuit breaker as a pure state machine that takes `now`.

    closed --(N failures in a row | error rate over the window | P99 over target)--> open
    open --(open period passed)--> half-open
    half-open --(`probes` probe requests all succeed)--> closed
    half-open --(a probe fails)--> open, for a longer period

Why not the `circuitbreaker` package (a dependency in pyproject.toml): it cannot express what
failover needs.  It reads time.monotonic() itself, so it cannot be driven by a fake clock
without sleeping or patching the module; it counts only consecutive failures (any success
resets the count), with no error-rate or latency window; its half-open state lets every call
through and closes on the first success, where we admit a fixed number of probes; its recovery
timeout is fixed, with no backoff on repeated re-opens; and it learns outcomes by wrapping a
call and catching exceptions, while ours arrive as stream events (a stream can fail after its
first token, and a client cancellation is no failure), so we report them explicitly.  Every
method of a subclass would be overridden; this is that subclass without the base.

Each pass the breaker grants is stamped with the breaker's epoch, which changes on every open
and close.  An outcome whose pass is from another epoch was decided under a state that is
gone (a request started before the breaker opened and finished after), and is ignored: it
neither trips a freshly closed breaker nor counts as a probe.

Invariant: every pass from `acquire` ends in exactly one `record` or `release`; a probe pass
that never does holds its half-open slot for good.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import NamedTuple

from services.router.failover.config import BreakerConfig
from services.router.failover.window import OutcomeWindow, p99

CAUSES = ("failures", "error_rate", "latency", "probe")   # Breaker.cause: in a row, rate, P99, probe failed


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Pass(NamedTuple):
    """Leave to send one request; give it back with Breaker.record or Breaker.release."""

    epoch: int
    probe: bool      # granted in half-open: its outcome decides whether the breaker closes


class Breaker:
    def __init__(self, config: BreakerConfig | None = None):
        self.config = config or BreakerConfig()
        self.window = OutcomeWindow(self.config.window_s)
        self.reason = ""                 # why it opened, with the numbers, for logs; "" while closed
        self.cause = ""                  # the same as a metrics label: one of CAUSES; "" while closed
        self.opened = 0                  # times it has opened, in all
        self._epoch = 0
        self._open = False
        self._open_until = 0.0
        self._closed_at = -math.inf
        self._level = 0                  # re-opens in a row: the backoff exponent
        self._consecutive = 0            # failures in a row while closed
        self._probes_out = 0             # half-open probes granted and not yet back
        self._probes_ok = 0              # half-open probes that succeeded

    # -- state at `now` ----------------------------------------------------------------
    def state(self, now: float) -> BreakerState:
        if not self._open:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now < self._open_until else BreakerState.HALF_OPEN

    @property
    def half_open_at(self) -> float | None:
        """When the breaker lets probes through (already, if in the past); None while closed."""
        return self._open_until if self._open else None

    @property
    def level(self) -> int:
        return self._level

    def allows(self, now: float) -> bool:
        """Whether `acquire(now)` would grant a pass."""
        state = self.state(now)
        if state is BreakerState.HALF_OPEN:
            return self._probes_out + self._probes_ok < self.config.probes
        return state is BreakerState.CLOSED

    # -- passes ------------------------------------------------------------------------
    def current(self, granted: Pass) -> bool:
        """Whether `granted` is from the breaker's present state, not from before an open or close."""
        return granted.epoch == self._epoch

    def acquire(self, now: float) -> Pass | None:
        """A pass for one request, or None: open, or half-open with every probe granted."""
        if not self.allows(now):
            return None
        if self.state(now) is BreakerState.HALF_OPEN:
            self._probes_out += 1
            return Pass(self._epoch, probe=True)
        return Pass(self._epoch, probe=False)

    def release(self, granted: Pass) -> None:
        """The request never reached the replica, or its client went away: no outcome, and a
        probe's slot goes to the next request."""
        if granted.probe and granted.epoch == self._epoch:
            self._probes_out -= 1

    def record(self, granted: Pass, now: float, ok: bool, latency_s: float | None = None) -> None:
        """The outcome of the request `granted` let through.  latency_s: what the P99 target
        judges (the router uses time to first token); None when not measured."""
        if granted.epoch != self._epoch:
            return
        if granted.probe:
            # One probe cannot judge a P99, so a probe is judged on ok alone; a replica that is
            # still slow fills the window again soon, and re-trips with a longer open period
            # because it has not stayed closed for a whole window (see _trip).
            self._probes_out -= 1
            if not ok:
                self._trip(now, "probe", "a half-open probe failed", repeat=True)
            else:
                self._probes_ok += 1
                if self._probes_ok >= self.config.probes:
                    self._close(now)
            return
        self.window.add(now, ok, latency_s)
        self._consecutive = 0 if ok else self._consecutive + 1
        cause, reason = self._trip_reason(now, ok)
        if cause:
            self._trip(now, cause, reason, repeat=now - self._closed_at < self.config.window_s)

    # -- transitions -------------------------------------------------------------------
    def _trip_reason(self, now: float, ok: bool) -> tuple[str, str]:
        """(cause, reason) when the breaker should open now, else ("", "")."""
        c = self.config
        if self._consecutive >= c.failure_threshold:
            return "failures", f"{self._consecutive} consecutive failures"
        n = self.window.count(now)
        rate = self.window.error_rate(now)
        if n >= c.min_samples and rate > c.error_rate:
            return "error_rate", f"error rate {rate:.1%} > {c.error_rate:.1%} over {n} requests in {c.window_s:g} s"
        if ok and c.p99_target_s is not None:       # only a success can raise the P99
            latencies = self.window.latencies(now)
            if len(latencies) >= c.latency_min_samples and (slow := p99(latencies)) > c.p99_target_s:
                return "latency", (f"p99 latency {slow:.3f} s > {c.p99_target_s:g} s over {len(latencies)} "
                                   f"requests in {c.window_s:g} s")
        return "", ""

    def open_period(self, level: int) -> float:
        c = self.config
        return min(c.open_s * c.backoff ** level, c.max_open_s)

    def _trip(self, now: float, cause: str, reason: str, repeat: bool) -> None:
        """Open now.  `repeat`: this opening follows the last one too closely (a probe failed,
        or the breaker had not yet stayed closed for a whole window), so it lasts one level
        longer; otherwise the backoff starts over."""
        if not repeat:
            self._level = 0
        elif self.open_period(self._level) < self.config.max_open_s:
            self._level += 1      # stop at the cap, so backoff ** level cannot overflow
        self._open, self._open_until = True, now + self.open_period(self._level)
        self.cause, self.reason = cause, reason
        self.opened += 1
        self._new_epoch()

    def _close(self, now: float) -> None:
        self._open, self._closed_at, self.cause, self.reason = False, now, "", ""
        self._new_epoch()

    def _new_epoch(self) -> None:
        self._epoch += 1
        self._consecutive = self._probes_out = self._probes_ok = 0
        self.window.clear()
