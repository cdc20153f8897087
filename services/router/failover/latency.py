"""LatencyGuard: level 3 by latency.  While a model's P95 time to first token stays over its target,
a share of its interactive requests goes to the next model of its fallback chain.  Pure: takes `now`.

What is measured: the router's own time to first token (routed to first token, per attempt) of the
interactive attempts each model served, over a sliding window of `window_s` (LatencyConfig).  Batch
requests are neither measured nor degraded: the engines schedule them behind interactive work, so their
first tokens are slow by design and would raise the P95 of a model that serves its interactive
traffic well; and a batch caller waits for the full model's answer rather than take a worse one sooner
(deadlines, failures and shedding still apply to it as before).

Per model, judged at every look (each measured first token and each interactive request):

    normal    --(P95 > target, over >= min_samples, at every look for after_s)--> degrading
    degrading --(P95 <= recover * target, or fewer than min_samples in the window)--> normal

Leaving at recover * target (0.9 by default) rather than at the target is the hysteresis: a P95 that
hovers at the target does not flip the model in and out; and entering only after after_s over target
keeps one slow burst from degrading anyone.  Too few samples is no evidence of slowness: normal.

While degrading, `share` of the model's interactive requests go to its fallback: a running credit
gains `share` per request and sends one to the fallback each time it reaches 1, so 0.3 sends the 4th,
7th and 10th of every ten, exactly 30% and never two in a row.  The decision is made once per request
(Call), and it is a preference: when no replica of the fallback is admitted, the request stays on
its model (levels.py), so latency alone never sheds a request.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from services.router.failover.config import LatencyConfig


class TtftWindow:
    """Times to first token of the last `window_s` seconds, kept sorted for the P95 as well as in
    arrival order for expiry: adding or expiring one sample is a bisect and a memmove, no sort."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._arrivals: deque[tuple[float, float]] = deque()     # (at, seconds)
        self._sorted: list[float] = []

    def add(self, now: float, ttft_s: float) -> None:
        self._expire(now)
        self._arrivals.append((now, ttft_s))
        insort(self._sorted, ttft_s)

    def _expire(self, now: float) -> None:
        while self._arrivals and self._arrivals[0][0] <= now - self.window_s:
            _, old = self._arrivals.popleft()
            del self._sorted[bisect_left(self._sorted, old)]

    def count(self, now: float) -> int:
        self._expire(now)
        return len(self._sorted)

    def p95(self, now: float) -> float | None:
        """Nearest-rank 95th percentile (the value 95% of the samples are at or below); None if empty."""
        self._expire(now)
        if not self._sorted:
            return None
        return self._sorted[math.ceil(0.95 * len(self._sorted)) - 1]


class LatencyState(NamedTuple):
    degrading: bool
    p95_s: float | None          # None: fewer than min_samples in the window (no verdict)
    samples: int
    over_since: float | None     # since when every look saw the P95 over target; None: not over


@dataclass
class _Model:
    window: TtftWindow
    degrading: bool = False
    over_since: float | None = None
    credit: float = 0.0


class LatencyGuard:
    def __init__(self, config: LatencyConfig):
        self.config = config
        self._models: dict[str, _Model] = {}
        self.events: list[str] = []          # transitions not yet taken by take_events(), for the log
        self.episodes = 0                    # times any model started degrading, in all

    @property
    def enabled(self) -> bool:
        return self.config.target_s is not None

    def _model(self, model: str) -> _Model:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _Model(TtftWindow(self.config.window_s))
        return state

    def record(self, model: str, now: float, ttft_s: float) -> None:
        """An interactive attempt on `model` got its first token `ttft_s` after it was routed."""
        if not self.enabled:
            return
        self._model(model).window.add(now, ttft_s)
        self.state(model, now)

    def state(self, model: str, now: float) -> LatencyState:
        """The model's state at `now`, after judging it (this is a look)."""
        c, m = self.config, self._model(model)
        target = c.target_s if c.target_s is not None else math.inf
        samples = m.window.count(now)
        p95 = m.window.p95(now) if samples >= c.min_samples else None
        if p95 is None or p95 <= target:
            m.over_since = None
        elif m.over_since is None:
            m.over_since = now
        if m.degrading and (p95 is None or p95 <= c.recover * target):
            m.degrading = False
            self.events.append(f"model {model}: P95 time to first token "
                               f"{'unknown' if p95 is None else f'{p95:.3f} s'} ({samples} samples), back within "
                               f"{c.recover:g} x {target:g} s: no more latency degradation")
        elif not m.degrading and m.over_since is not None and now - m.over_since >= c.after_s:
            m.degrading, m.credit = True, 0.0
            self.episodes += 1
            self.events.append(f"model {model}: P95 time to first token {p95:.3f} s over {target:g} s for "
                               f"{now - m.over_since:.1f} s ({samples} samples in {c.window_s:g} s): "
                               f"{c.share:.0%} of its interactive requests go to its fallback")
        return LatencyState(m.degrading, p95, samples, m.over_since)

    def take(self, model: str, now: float) -> bool:
        """Whether this interactive request for `model` goes to its fallback (a look, and while
        degrading one step of the share's credit)."""
        if not self.enabled or not self.state(model, now).degrading:
            return False
        m = self._models[model]
        m.credit += self.config.share
        if m.credit >= 1.0 - 1e-9:           # 0.3 * 10 is not exactly 3 in binary
            m.credit -= 1.0
            return True
        return False

    def reason(self, model: str, now: float) -> str:
        """Why `model`'s requests are being degraded, for Plan.why."""
        s = self.state(model, now)
        p95 = "unknown" if s.p95_s is None else f"{s.p95_s:.3f} s"
        return (f"{model}: P95 time to first token {p95} over the {self.config.target_s:g} s target; "
                f"{self.config.share:.0%} of its interactive requests go to the fallback")

    def states(self, now: float) -> dict[str, LatencyState]:
        return {model: self.state(model, now) for model in sorted(self._models)}

    def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events
