"""Balancing policies: pure code that takes replica state and `now` and returns a choice.

The contract (policy.py): `pick(candidates, request, now) -> Decision`, where candidates are
the healthy replicas serving request.model in the table's stable order, and the hooks
`on_start(replica, request, now)` / `on_finish(replica, request, now, latency_s, ok)`.
`pick` raises NoReplica on an empty pool and PinnedReplicaUnavailable when the pinned replica
is not a candidate.  `load_entropy(now)` is in [0, 1] for metrics.

A dict registry: the router's config names one of POLICIES, and `POLICIES[name](config)`
(config: PolicyConfig, optional) builds it.  A name is a base policy, then optionally
affinity layers in canonical order, joined by "+":

    round_robin | least_load | balancing   [+region] [+prefix] [+session]

e.g. "balancing+prefix+session".  Every entry is an AffinityRouter (with no layers for a bare
base name), so a pinned replica is honoured by every policy.

Every policy honours Replica.weight (weighted.py): smooth weighted round-robin for round_robin, load
per unit of weight for least_load, balancing and the affinity layers' overload test, and weight 0
as a standby that takes new requests only when no candidate of weight > 0 is left.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import combinations

from services.router.policies.affinity import LAYERS, AffinityRouter
from services.router.policies.balancing import Balancing
from services.router.policies.config import PolicyConfig
from services.router.policies.least_load import LeastLoad
from services.router.policies.policy import (
    Decision,
    LoadEntropy,
    NoReplica,
    PinnedReplicaUnavailable,
    Policy,
    RouteRequest,
)
from services.router.policies.round_robin import RoundRobin

BASES: dict[str, Callable[[PolicyConfig], Policy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "balancing": Balancing,
}


def make_policy(name: str, config: PolicyConfig | None = None) -> AffinityRouter:
    base, *layers = name.split("+")
    if base not in BASES:
        raise ValueError(f"unknown base policy {base!r} in {name!r}; known: {', '.join(BASES)}")
    unknown = [layer for layer in layers if layer not in LAYERS]
    if unknown:
        raise ValueError(f"unknown affinity layer(s) {', '.join(unknown)} in {name!r}; known: {', '.join(LAYERS)}")
    if layers != [layer for layer in LAYERS if layer in layers]:
        raise ValueError(f"affinity layers in {name!r} must be distinct, in the order {'+'.join(LAYERS)}")
    config = config or PolicyConfig()
    return AffinityRouter(BASES[base](config), layers, config)


def _names() -> list[str]:
    return [
        "+".join((base, *layers))
        for base in BASES
        for k in range(len(LAYERS) + 1)
        for layers in combinations(LAYERS, k)
    ]


POLICIES: dict[str, Callable[..., AffinityRouter]] = {name: partial(make_policy, name) for name in _names()}

__all__ = [
    "BASES", "POLICIES", "AffinityRouter", "Balancing", "Decision", "LeastLoad", "LoadEntropy", "NoReplica",
    "PinnedReplicaUnavailable", "Policy", "PolicyConfig", "RoundRobin", "RouteRequest", "make_policy",
]
