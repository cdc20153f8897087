"""Least-load: the replica with the fewest outstanding requests (in_flight + waiting) per unit of weight.

Weighted (weighted.py): outstanding / weight is the load compared, over the candidates of weight > 0;
ties (idle replicas, say) take turns by smooth weighted round-robin, in candidate order when the tied
replicas' weights are equal.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.policies.config import PolicyConfig
from services.router.policies.policy import Decision, Policy, RouteRequest
from services.router.policies.weighted import SmoothWeighted, load_per_weight, serving, ties
from services.router.replicas import Replica


class LeastLoad(Policy):
    def __init__(self, config: PolicyConfig | None = None):
        super().__init__((config or PolicyConfig()).entropy_window_s)
        self.turns = SmoothWeighted()

    def choose(self, candidates: Sequence[Replica], request: RouteRequest, now: float) -> Decision:
        pool = serving(candidates)
        loads = [load_per_weight(r) for r in pool]
        tied = ties(pool, loads, min(loads))
        # Only ties take a turn: a replica that wins outright leaves the tie rotation where it was.
        return Decision(tied[0] if len(tied) == 1 else self.turns.pick(tied), "balance")
