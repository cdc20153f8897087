"""RetryBudget: retries shared by all requests, so that failures cannot turn into a retry storm.

Over any `window_s`, retries may add at most `ratio` on top of the requests (new requests,
not counting retries) plus `min_per_s * window_s`, the floor that lets low traffic retry:

    allowed  <=>  retries in the window + 1 <= ratio * requests in the window + min_per_s * window_s

This is Envoy's retry budget (a share of active requests, with a minimum) expressed over a rate,
as docs/architecture.md ("Failover", level 2) states it.  A window rather than gRPC's token
bucket because the bound is then exact and easy to state: a burst of failures can retry at most
the budget, and the budget comes back as old requests and retries leave the window.
"""

from __future__ import annotations

from collections import deque


class RetryBudget:
    def __init__(self, ratio: float = 0.2, min_per_s: float = 1.0, window_s: float = 10.0):
        if ratio < 0 or min_per_s < 0 or window_s <= 0:
            raise ValueError("ratio and min_per_s must be >= 0 and window_s positive")
        self.ratio, self.min_per_s, self.window_s = ratio, min_per_s, window_s
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()
        self.refused = 0                  # retries refused, in all (a metric)

    def note_request(self, now: float) -> None:
        """A new request arrived (its first attempt); retries are not requests."""
        self._requests.append(now)

    def available(self, now: float) -> float:
        """Retries the budget still allows in the window ending at `now` (may be fractional)."""
        for times in (self._requests, self._retries):
            while times and times[0] <= now - self.window_s:
                times.popleft()
        return self.ratio * len(self._requests) + self.min_per_s * self.window_s - len(self._retries)

    def try_spend(self, now: float) -> bool:
        """Take one retry from the budget: True when allowed (and counted), False when spent."""
        if self.available(now) >= 1 - 1e-9:      # 0.2 * n is not always exact in binary
            self._retries.append(now)
            return True
        self.refused += 1
        return False
