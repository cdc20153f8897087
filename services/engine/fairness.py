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

from mesh.request_limits import MAX_WEIGHT


def check_weight(weight: float) -> None:
    """ValueError unless 0 < weight <= MAX_WEIGHT."""
    if not 0.0 < weight <= MAX_WEIGHT:
        raise ValueError(f"weight {weight:g} must be above 0 and at most {MAX_WEIGHT:g}")


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
