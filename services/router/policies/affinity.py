"""Affinity layers over a balancing policy: pinned, region, session holder, prefix, session, then balance.

    pinned   the request names a replica: that one, or PinnedReplicaUnavailable.
    region   a filter: keep the candidates in the request's region (the router's own when the
             request names none) unless every one of them is overloaded; then spill to all.
    holder   (with the session layer) a session that has a replica, the one its last request
             started on, stays there unless it is gone or overloaded: two sessions whose histories
             coincide must not swap replicas through the prefix map.
    prefix   the longest prompt prefix this router has sent somewhere: that replica, which
             still holds its KV blocks, unless overloaded (then the next shorter known prefix
             on another replica, down to min_prefix_blocks).
    session  consistent hashing of the session key over the candidate ids: the ring owner,
             or the next replica clockwise while the owner is overloaded.  Only when prefix
             affinity knew nothing of the prompt: if it knew a holder that is overloaded, the
             ring owner has no better claim than any other replica, and balance decides.
    base     the balancing policy decides among the (region-filtered) candidates.

Layers are tried in that order; each either decides or passes.  A session's holder comes first:
docs/architecture.md ("Router") promises a session's requests stay on one replica, and the
prefix map would otherwise send a session wherever another session with the same history was
cached (issue 20).  For a session new to this router, prefix comes before the ring because a
session's earlier turns are themselves prefixes of its next prompt: following the prefix map
lands where the history is cached even when an earlier turn had to spill off the ring owner, and
session hashing still places what prefix affinity cannot (a prompt this router has not seen:
after a restart, behind another router, without token ids).  With one router and token ids the
session layer is redundant, and its load-blind placement of new prefixes costs P99
(bench/router_sim.py): prefer "balancing+prefix" there.

Overloaded (PolicyConfig): Replica.queued > max_queued, or Replica.mem_ratio > max_mem_ratio,
or its load per unit of weight (Replica.outstanding / weight, weighted.py; just outstanding at the
default weight 1) more than max_imbalance above the least loaded candidate's.  The last
is the one that matters for an engine that admits everything it has KV for: its queue stays
empty while its batch grows, and every request in a batch of 30 decodes nearly four times
slower than in a batch of 5.  In bench/router_sim.py with 16 hot prefixes, queue and memory
limits alone let them pile up: P99 20 s against 13 s with max_imbalance=4, and 67 s against
13 s with session affinity on top.  When every candidate is overloaded, affinity gives
way and the base policy still picks the best of them: shedding is failover's decision.

Standbys (weight 0, weighted.py) are left out before any layer but pinned looks: no session, prefix
or ring sends new work to a standby while a replica of weight > 0 is a candidate.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.router.policies.config import PolicyConfig
from services.router.policies.hash_ring import HashRing
from services.router.policies.policy import Decision, PinnedReplicaUnavailable, Policy, RouteRequest
from services.router.policies.prefix_map import PrefixMap
from services.router.policies.weighted import load_per_weight, serving
from services.router.replicas import Replica

LAYERS = ("region", "prefix", "session")   # the canonical order of layer names in a policy name


class AffinityRouter(Policy):
    def __init__(self, base: Policy, layers: Sequence[str] = (), config: PolicyConfig | None = None):
        unknown = set(layers) - set(LAYERS)
        if unknown:
            raise ValueError(f"unknown affinity layers {sorted(unknown)}; known: {', '.join(LAYERS)}")
        self.config = config or PolicyConfig()
        super().__init__(self.config.entropy_window_s)
        self.base = base
        self.layers = frozenset(layers)
        self.prefixes = PrefixMap(self.config.prefix_capacity)
        self.holders: OrderedDict[str, str] = OrderedDict()    # session key -> replica id (LRU)
        self._ring: HashRing | None = None

    def overloaded(self, replica: Replica, least: float) -> bool:
        """least: the smallest load per weight (weighted.load_per_weight) among the candidates it is
        compared with (`least_load(pool)`)."""
        c = self.config
        return (replica.queued > c.max_queued or replica.mem_ratio > c.max_mem_ratio
                or load_per_weight(replica) - least > c.max_imbalance)

    def choose(self, candidates: Sequence[Replica], request: RouteRequest, now: float) -> Decision:
        if request.pinned:
            for r in candidates:
                if r.replica_id == request.pinned:
                    return Decision(r, "pinned")
            raise PinnedReplicaUnavailable(request.pinned)
        candidates = serving(candidates)
        pool, narrowed = candidates, ""
        if "region" in self.layers:
            pool, narrowed = self._region_pool(candidates, request)
        if "session" in self.layers and request.session_key:
            holder = self._holder(pool, request.session_key)
            if holder is not None:
                return Decision(holder, "session")
        matched = False
        if "prefix" in self.layers and request.prefix_hashes:
            replica, matched = self._by_prefix(pool, request.prefix_hashes)
            if replica is not None:
                return Decision(replica, "prefix")
        if "session" in self.layers and request.session_key and not matched:
            replica = self._by_session(pool, request.session_key)
            if replica is not None:
                return Decision(replica, "session")
        decision = self.base.choose(pool, request, now)
        return Decision(decision.replica, narrowed or decision.reason)

    def _region_pool(self, candidates: Sequence[Replica], request: RouteRequest) -> tuple[Sequence[Replica], str]:
        """(pool, reason): the same-region candidates ("region") unless none can take the
        request; then everyone ("spill", or "" when there was no one in the region at all)."""
        region = request.region or self.config.region
        local = [r for r in candidates if r.region == region]
        if len(local) == len(candidates):
            return candidates, ""
        least = least_load(candidates)
        if any(not self.overloaded(r, least) for r in local):
            return local, "region"
        return candidates, "spill" if local else ""

    def _by_prefix(self, pool: Sequence[Replica], hashes: Sequence[bytes]) -> tuple[Replica | None, bool]:
        """(replica, matched): the holder of the longest known prefix that can take the request;
        matched tells whether any holder in the pool was known, overloaded or not."""
        by_id = {r.replica_id: r for r in pool}
        least = least_load(pool)
        refused: set[str] = set()
        for rid, blocks in self.prefixes.matches(hashes):
            if blocks < self.config.min_prefix_blocks:
                break
            if rid in refused:
                continue
            replica = by_id.get(rid)
            if replica is None:
                continue
            if not self.overloaded(replica, least):
                return replica, True
            refused.add(rid)
        return None, bool(refused)

    def _holder(self, pool: Sequence[Replica], key: str) -> Replica | None:
        """The replica the session's last request started on, if it is a candidate and not overloaded."""
        rid = self.holders.get(key)
        if rid is None:
            return None
        self.holders.move_to_end(key)
        replica = next((r for r in pool if r.replica_id == rid), None)
        if replica is None or self.overloaded(replica, least_load(pool)):
            return None
        return replica

    def _by_session(self, pool: Sequence[Replica], key: str) -> Replica | None:
        ids = frozenset(r.replica_id for r in pool)
        if self._ring is None or self._ring.replica_ids != ids:
            # The pool changes rarely (health, discovery, region spill); one cached ring
            # keeps the common case free of rebuilding.
            self._ring = HashRing(ids, self.config.vnodes)
        by_id = {r.replica_id: r for r in pool}
        least = least_load(pool)
        for rid in self._ring.walk(key):
            if not self.overloaded(by_id[rid], least):
                return by_id[rid]
        return None

    def on_start(self, replica: Replica, request: RouteRequest, now: float) -> None:
        super().on_start(replica, request, now)
        self.base.on_start(replica, request, now)
        if "prefix" in self.layers and request.prefix_hashes:
            self.prefixes.record(request.prefix_hashes, replica.replica_id)
        if "session" in self.layers and request.session_key:
            self.holders[request.session_key] = replica.replica_id
            self.holders.move_to_end(request.session_key)
            if len(self.holders) > self.config.session_capacity:
                self.holders.popitem(last=False)

    def on_finish(self, replica: Replica, request: RouteRequest, now: float, latency_s: float, ok: bool) -> None:
        self.base.on_finish(replica, request, now, latency_s, ok)

    def forget(self, replica_id: str) -> None:
        """A replica left for good: stop sending prefixes its way (lookups skip it anyway)."""
        self.prefixes.forget(replica_id)
        for key in [k for k, rid in self.holders.items() if rid == replica_id]:
            del self.holders[key]


def least_load(pool: Sequence[Replica]) -> float:
    return min(load_per_weight(r) for r in pool)
