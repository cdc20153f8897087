"""Round-robin over the candidates: the baseline every other policy is measured against."""

from __future__ import annotations

from collections.abc import Sequence

from services.router.policies.config import PolicyConfig
from services.router.policies.policy import Decision, Policy, RouteRequest
from services.router.replicas import Replica


class RoundRobin(Policy):
    def __init__(self, config: PolicyConfig | None = None):
        super().__init__((config or PolicyConfig()).entropy_window_s)
        self._next = 0

    def choose(self, candidates: Sequence[Replica], request: RouteRequest, now: float) -> Decision:
        # One counter over a changing pool: a replica joining or leaving shifts the turn,
        # which is harmless; no replica is skipped for long.
        choice = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(choice, "balance")
