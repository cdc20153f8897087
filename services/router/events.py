"""What the router did lately, for the console (the edge's GET /admin/console, via ListReplicas): the
recent failovers, isolations, degraded and shed requests, and the time to first token of the
requests it served.  One per router process, like its metrics."""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import NamedTuple

KEEP_EVENTS = 100
TTFT_WINDOW_S = 60.0


class Event(NamedTuple):
    unix_ms: int
    kind: str           # failover | isolated | degraded | shed | lora_loaded
    model: str
    replica: str
    detail: str


class RecentEvents:
    def __init__(self, keep: int = KEEP_EVENTS, window_s: float = TTFT_WINDOW_S):
        self.events: deque[Event] = deque(maxlen=keep)
        self.window_s = window_s
        self._ttft: deque[tuple[float, float]] = deque(maxlen=10_000)    # (monotonic time, seconds)

    def record(self, kind: str, model: str, replica: str = "", detail: str = "") -> None:
        self.events.append(Event(int(time.time() * 1000), kind, model, replica, detail[:300]))

    def first_token(self, seconds: float | None, now: float | None = None) -> None:
        if seconds is not None:
            self._ttft.append((time.monotonic() if now is None else now, seconds))

    def ttft_ms(self, now: float | None = None) -> tuple[float, float]:
        """(p50, p95) of the time to first token over the last window, in ms; (0, 0) with no request."""
        now = time.monotonic() if now is None else now
        while self._ttft and self._ttft[0][0] < now - self.window_s:
            self._ttft.popleft()
        values = sorted(s for _, s in self._ttft)
        if not values:
            return 0.0, 0.0
        return statistics.median(values) * 1000, values[min(len(values) - 1, int(0.95 * len(values)))] * 1000



RECENT = RecentEvents()
