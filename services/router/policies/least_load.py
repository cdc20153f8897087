"""Least-load: the replica with the fewest outstanding requests (in_flight + waiting)."""

from __future__ import annotations

from collections.abc import Sequence

from services.router.policies.config import PolicyConfig
from services.router.policies.policy import Decision, Policy, RouteRequest, rotate_ties
from services.router.replicas import Replica


class LeastLoad(Policy):
    def __init__(self, config: PolicyConfig | None = None):
        super().__init__((config or PolicyConfig()).entropy_window_s)
        self._ties = 0

    def choose(self, candidates: Sequence[Replica], request: RouteRequest, now: float) -> Decision:
        least = min(r.outstanding for r in candidates)
        tied = [r for r in candidates if r.outstanding == least]
        if len(tied) > 1:
            self._ties += 1
            return Decision(rotate_ties(tied, self._ties - 1), "balance")
        return Decision(tied[0], "balance")
