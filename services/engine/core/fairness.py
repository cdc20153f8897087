"""Weighted fair queuing between tenants: each tenant's virtual time.  Pure: no clocks, no I/O.

A tenant's virtual time is the tokens the engine computed for it (prefill, recompute after a
preemption, decode and draft rows) divided by its weight (its tier's `weight`).  The scheduler gives
each step's rows to the tenant with the lowest virtual time first, so two tenants that both have
more work than the engine can run are served tokens in the ratio of their weights, and a tenant with
little work (one stream) gets all it asks for.

A tenant that becomes active (its first waiting or running request after none) starts at the lowest
virtual time among the active tenants, never below: time spent idle is not credit to spend later on
a burst that would shut the others out.  Likewise after each step, an active tenant whose every request
ran (it asked for less than its share) is raised to the lowest virtual time of the tenants left with work
waiting: running below its share does not bank credit either (one stream, then a burst of 24, would
otherwise take every row until its clock caught up).
"""

from __future__ import annotations

from collections import Counter

from mesh.ratelimit import over_fair_share
from mesh.request_limits import MAX_WEIGHT


def check_weight(weight: float) -> None:
    """ValueError unless 0 < weight <= MAX_WEIGHT."""
    if not 0.0 < weight <= MAX_WEIGHT:
        raise ValueError(f"weight {weight:g} must be above 0 and at most {MAX_WEIGHT:g}")


MAX_SLOWDOWN = 100.0


def check_slowdown(slowdown: float) -> None:
    """ValueError unless the row cap's slowdown is 0 (off) or from 1 to MAX_SLOWDOWN."""
    if slowdown and not 1.0 <= slowdown <= MAX_SLOWDOWN:
        raise ValueError(f"fair slowdown {slowdown:g} must be 0 (no row cap) or from 1 to {MAX_SLOWDOWN:g}")


class TenantClocks:
    """Virtual time and weight per tenant, and which tenants have requests in the engine."""

    def __init__(self) -> None:
        self.vtime: dict[str, float] = {}
        self.weight: dict[str, float] = {}
        self.active: Counter[str] = Counter()     # tenant -> its requests waiting or running
        self.floor = 0.0                          # lowest virtual time of the active tenants, last seen

    def arrive(self, tenant: str, weight: float) -> None:
        """A request of `tenant` joins (its tier's weight is the tenant's from now on)."""
        if not self.active[tenant]:
            self.floor = self._lowest_active(self.floor)
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), self.floor)
        self.active[tenant] += 1
        self.weight[tenant] = weight

    def leave(self, tenant: str) -> None:
        """A request of `tenant` ended.  An idle tenant's time is forgotten once the others pass it."""
        self.floor = self._lowest_active(self.floor)        # before it goes: the last one leaves its time
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]
            for name in [n for n, v in self.vtime.items() if n not in self.active and v <= self.floor]:
                del self.vtime[name], self.weight[name]

    def keep_up(self, backlogged: set[str]) -> None:
        """After a step: the active tenants not in `backlogged` (every request of theirs ran) are raised to the
        lowest virtual time among those that are (some request of theirs waited)."""
        times = [self.vtime.get(t, self.floor) for t in backlogged]
        if not times:
            return
        low = min(times)
        for tenant in self.active:
            if tenant not in backlogged and self.vtime.get(tenant, self.floor) < low:
                self.vtime[tenant] = low

    def charge(self, tenant: str, tokens: int) -> None:
        """The engine computed `tokens` for `tenant`."""
        self.vtime[tenant] = self.vtime.get(tenant, self.floor) + self.cost(tenant, tokens)

    def cost(self, tenant: str, tokens: int) -> float:
        """What `tokens` add to `tenant`'s virtual time."""
        return tokens / self.weight.get(tenant, 1.0)

    def _lowest_active(self, default: float) -> float:
        times = [self.vtime.get(t, default) for t in self.active]
        return max(default, min(times)) if times else default


class StepTimes:
    """Decode steps' wall time by their rows, as the engine measured them: a moving average per row count
    (steps of decode rows only; prefill chunks and drafts would mix in other work)."""

    SMOOTHING = 0.1     # a new step's weight in its row count's average
    CLIP = 3.0          # a step over 3x its row count's average counts as 3x (a pause of the machine, a GC)

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        if old is None:
            self.seconds[rows] = seconds
        else:
            self.seconds[rows] = old + self.SMOOTHING * (min(seconds, self.CLIP * old) - old)

    def predict(self, rows: int) -> float | None:
        """A step of `rows` decode rows: measured, else interpolated between the nearest row counts measured on
        either side; above the largest measured, that one's time (a lower bound); None below the smallest.
        Only neighbours count: a row count measured once under a passing load does not bend the others."""
        if rows in self.seconds:
            return self.seconds[rows]
        below = max((k for k in self.seconds if k < rows), default=None)
        if below is None:
            return None
        above = min((k for k in self.seconds if k > rows), default=None)
        if above is None:
            return self.seconds[below]
        low, high = self.seconds[below], self.seconds[above]
        return low + (high - low) * (rows - below) / (above - below)


def row_cap(slots: int, demand: dict[str, int], weight: dict[str, float], times: StepTimes,
            slowdown: float) -> int:
    """The most rows the next step may take so that no light tenant runs more than `slowdown` times below its
    share of the engine.  `weight`: every active tenant's; `demand`: the interactive requests of those that have
    any.  A tenant is light when its interactive requests fit in its weighted share of the `slots` (fair queuing
    then runs them all): alone it would decode them in steps of T(demand) seconds, its share is its weight over
    all the active tenants' (batch-class work holds a share of the engine too, though its rows come last), so
    the steps may last up to slowdown * T(demand) / share.  Other tenants' rows make steps longer; below the cap
    they take their turns (fair queuing decides which), and the cap leaves every other tenant one row.
    A light tenant's row count never timed sets no bound (until such a step has run); the others are
    interpolated (StepTimes.predict)."""
    total = sum(weight.values())
    if not total or slowdown <= 0:
        return slots
    light = {t: d for t, d in demand.items() if d <= weight[t] / total * slots}
    limits = [slowdown * alone * total / weight[t] for t, d in light.items() if (alone := times.predict(d))]
    if not limits:
        return slots
    rows, floor = slots, min(slots, sum(light.values()) + len(weight) - len(light))
    while rows > floor and (step := times.predict(rows)) is not None and step > min(limits):
        rows -= 1
    return rows


def waiting_refusal(waiting: Counter[str], tenant: str, limit: int) -> str | None:
    """Why a new request of `tenant` may not join the engine's waiting room of `limit` places (`waiting`: each
    tenant's waiting requests), or None: the room is full, or the tenant holds its fair share of a room nearly
    full (mesh.ratelimit.over_fair_share, the edge's rule for its places: a flood leaves the others a quarter)."""
    if sum(waiting.values()) >= limit:
        return f"engine queue is full ({limit} waiting requests); retry later"
    if over_fair_share(waiting, tenant, limit):
        return (f"this tenant holds {waiting[tenant]} of the engine's {limit} waiting places, its share while "
                "the queue is nearly full; retry later")
    return None
