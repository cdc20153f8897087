"""OutcomeWindow: the outcomes of the last `window_s` seconds, for error rates and P99 latency."""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple


class Outcome(NamedTuple):
    at: float
    ok: bool
    latency_s: float | None     # None: not measured (a failure before the first token, say)


class OutcomeWindow:
    """A sliding time window of outcomes.  An outcome recorded at `at` counts while
    now - at < window_s, so a window of 10 s at now=10 no longer holds what happened at 0."""

    def __init__(self, window_s: float):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._outcomes: deque[Outcome] = deque()
        self._failures = 0

    def add(self, now: float, ok: bool, latency_s: float | None) -> None:
        self._outcomes.append(Outcome(now, ok, latency_s))
        self._failures += not ok
        self._expire(now)

    def clear(self) -> None:
        self._outcomes.clear()
        self._failures = 0

    def _expire(self, now: float) -> None:
        while self._outcomes and self._outcomes[0].at <= now - self.window_s:
            self._failures -= not self._outcomes.popleft().ok

    def count(self, now: float) -> int:
        self._expire(now)
        return len(self._outcomes)

    def error_rate(self, now: float) -> float:
        """failures / outcomes; 0.0 for an empty window."""
        n = self.count(now)
        return self._failures / n if n else 0.0

    def latencies(self, now: float) -> list[float]:
        """The measured latencies of the window's successes, sorted.  Failures are left out:
        how fast a replica fails says nothing about how fast it serves."""
        self._expire(now)
        return sorted(o.latency_s for o in self._outcomes if o.ok and o.latency_s is not None)


def p99(sorted_latencies: list[float]) -> float:
    """Nearest-rank 99th percentile of a non-empty sorted list: the value that 99% of the
    samples are at or below.  With fewer than 100 samples that is the largest one."""
    return sorted_latencies[math.ceil(0.99 * len(sorted_latencies)) - 1]
