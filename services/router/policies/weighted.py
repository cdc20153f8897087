"""Replica weights (Replica.weight, from discovery): each replica's share of new requests, in every policy.

    standby      weight 0 is a standby: it takes new requests only while no candidate of weight > 0
                 is left (candidates are what failover admits: healthy, not isolated, breaker closed,
                 not saturated); the standbys then share them as if each had weight 1.  A pinned
                 request is the operator's choice and goes to its replica whatever the weight.
    round_robin  smooth weighted round-robin (below).
    least_load,  load per unit of weight, outstanding / weight, stands for outstanding, so under
    balancing    concurrency a replica of weight 3 carries three times the requests of one of weight 1;
                 ties (idle replicas all load 0) are broken by smooth weighted round-robin among the
                 tied, so sequential traffic also splits 3:1 instead of rotating evenly.
    affinity     a replica is overloaded when its load per weight is max_imbalance above the least's.

Smooth weighted round-robin, as nginx's upstream module does it: every replica keeps a `current`
value; each pick adds every candidate's weight to its current, takes the candidate with the largest
(the first in candidate order on a tie) and takes the candidates' total weight off the winner.  Over
any W picks from a fixed pool of total weight W a replica of weight w is picked exactly w times, and
spread out: weights 5, 1, 1 give a a b a c a a, not a a a a a b c.  With equal weights it is plain
round-robin in candidate order.  A replica outside one pick's candidates (another region, a replica a
call already failed on) keeps its current; the currents of a pick's candidates change by +w and -W in
all, so the sum over every replica stays 0 and none can run up a debt or a credit without bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.replicas import Replica


def serving(candidates: Sequence[Replica]) -> Sequence[Replica]:
    """The standby rule: the candidates of weight > 0, or every candidate when none has any."""
    if all(r.weight > 0 for r in candidates):
        return candidates
    return [r for r in candidates if r.weight > 0] or candidates


def weight_of(replica: Replica) -> float:
    """The weight a policy uses: 1 for a standby (it is only a candidate when every one is a standby)."""
    return replica.weight if replica.weight > 0 else 1.0


def load_per_weight(replica: Replica) -> float:
    """Replica.outstanding per unit of weight: what least_load, balancing and affinity compare."""
    return replica.outstanding / weight_of(replica)


def ties(candidates: Sequence[Replica], values: Sequence[float], best: float) -> list[Replica]:
    """The candidates whose value equals `best`; the tolerance only absorbs rounding (1/0.3 and 10/3)."""
    slack = 1e-9 * max(1.0, abs(best))
    return [r for r, v in zip(candidates, values, strict=True) if abs(v - best) <= slack]


class SmoothWeighted:
    """Smooth weighted round-robin over whatever candidates each pick is given (see the module doc)."""

    def __init__(self) -> None:
        self._current: dict[str, float] = {}     # replica id -> current; ids seen so far (a few per replica)

    def pick(self, candidates: Sequence[Replica]) -> Replica:
        """One of `candidates` (non-empty)."""
        total, best, best_current = 0.0, candidates[0], float("-inf")
        for r in candidates:
            w = weight_of(r)
            current = self._current[r.replica_id] = self._current.get(r.replica_id, 0.0) + w
            total += w
            if current > best_current:
                best, best_current = r, current
        self._current[best.replica_id] -= total
        return best

    def current(self, replica_id: str) -> float:
        return self._current.get(replica_id, 0.0)

    def forget(self, replica_id: str) -> None:
        self._current.pop(replica_id, None)
