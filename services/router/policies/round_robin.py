"""Round-robin over the candidates: the baseline every other policy is measured against.

Weighted (weighted.py): smooth weighted round-robin, nginx's, over the candidates of weight > 0 (the
standbys of weight 0 only when there is nothing else); with equal weights, turns in candidate order.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.policies.config import PolicyConfig
from services.router.policies.policy import Decision, Policy, RouteRequest
from services.router.policies.weighted import SmoothWeighted, serving
from services.router.replicas import Replica


class RoundRobin(Policy):
    def __init__(self, config: PolicyConfig | None = None):
        super().__init__((config or PolicyConfig()).entropy_window_s)
        self.turns = SmoothWeighted()

    def choose(self, candidates: Sequence[Replica], request: RouteRequest, now: float) -> Decision:
        # The turns are kept per replica id over a changing pool: a replica joining starts level
        # with the others, one that leaves takes its place in the rotation with it.
        return Decision(self.turns.pick(serving(candidates)), "balance")
