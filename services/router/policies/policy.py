"""The contract every balancing policy keeps, and the vocabulary it speaks.

A policy is pure: it reads replica state and `now`, keeps its own bookkeeping, does no I/O
and never sleeps.  The router calls, for each request:

    decision = policy.pick(candidates, request, now)     # candidates: healthy, serving the model
    policy.on_start(decision.replica, request, now)      # once the request is sent to it
    ...
    policy.on_finish(decision.replica, request, now, latency_s, ok)

The router itself keeps Replica.in_flight and applies load reports; policies only read them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from services.router.replicas import Replica


class NoReplica(ValueError):
    """No candidate to choose from: the server answers UNAVAILABLE."""


class PinnedReplicaUnavailable(LookupError):
    """The request pins a replica that is not among the candidates (unknown, unhealthy or
    serving another model); the server tells which from its table (NOT_FOUND / UNAVAILABLE)."""

    def __init__(self, replica_id: str):
        super().__init__(f"pinned replica {replica_id!r} is not a healthy replica of this model")
        self.replica_id = replica_id


@dataclass(frozen=True)
class RouteRequest:
    model: str
    session_key: str = ""                     # x-session-id or the OpenAI `user` field; "" = none
    prefix_hashes: tuple[bytes, ...] = ()     # chained hashes of the prompt's full KV blocks (mesh.prefix)
    region: str = ""                          # caller's region; "" = the router's own
    pinned: str = ""                          # explicit replica id; "" = none
    tenant: str = ""                          # who asks: balancing steers a tenant off replicas it is heavy on


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str    # pinned | prefix | session | region | spill | balance: a metrics label


class LoadEntropy:
    """Shannon entropy of the per-replica share of the requests started in the last `window_s`,
    normalised by log(pool) to [0, 1]: 1.0 is an even spread, 0.0 everything on one replica.

    `pool` is the number of candidates the policy chose among, so replicas that got nothing
    lower the value.  With no requests in the window, or a pool of one, there is nothing
    unbalanced and the value is 1.0."""

    def __init__(self, window_s: float = 60.0):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._starts: deque[tuple[float, str]] = deque()
        self._counts: Counter[str] = Counter()

    def record(self, replica_id: str, now: float) -> None:
        self._starts.append((now, replica_id))
        self._counts[replica_id] += 1

    def value(self, now: float, pool: int) -> float:
        while self._starts and self._starts[0][0] <= now - self.window_s:
            _, rid = self._starts.popleft()
            self._counts[rid] -= 1
            if not self._counts[rid]:
                del self._counts[rid]
        total = len(self._starts)
        n = max(pool, len(self._counts))
        if total == 0 or n <= 1:
            return 1.0
        h = -sum(c / total * math.log(c / total) for c in self._counts.values())
        return h / math.log(n)


class Policy(ABC):
    """Base of the balancing policies: validates candidates, tracks load entropy.

    Subclasses implement `choose` (candidates are non-empty there) and may extend the hooks,
    calling super() so the entropy stays counted."""

    def __init__(self, entropy_window_s: float = 60.0):
        self.entropy = LoadEntropy(entropy_window_s)
        self._pool = 0

    def pick(self, candidates: Sequence[Replica], request: RouteRequest, now: float) -> Decision:
        """candidates: healthy replicas serving request.model, in a stable order (the table's)."""
        if not candidates:
            raise NoReplica(f"no healthy replica serves {request.model!r}")
        self._pool = len(candidates)
        return self.choose(candidates, request, now)

    @abstractmethod
    def choose(self, candidates: Sequence[Replica], request: RouteRequest, now: float) -> Decision:
        """Pick one of `candidates` (non-empty)."""

    def on_start(self, replica: Replica, request: RouteRequest, now: float) -> None:
        self.entropy.record(replica.replica_id, now)

    def on_finish(self, replica: Replica, request: RouteRequest, now: float, latency_s: float, ok: bool) -> None:
        """latency_s: routed to finished; ok: False when the replica failed the request."""
        return None  # stateless by default; Balancing keeps a latency window here

    def load_entropy(self, now: float) -> float:
        return self.entropy.value(now, self._pool)

