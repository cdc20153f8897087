"""Admin: the operators' view of the router (models, version routing, replicas, gauges).

Read from the replica table, the version routing, the breakers and the policy; the server turns
these plain values into ListModels / GetModelRouting / SetModelRouting / ListReplicas replies,
and metrics reads `snapshot` when Prometheus scrapes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

from services.router import metrics
from services.router.failover import Failover
from services.router.lora import LoraAdapters
from services.router.policies import AffinityRouter
from services.router.replicas import Replica, ReplicaTable
from services.router.shadow import Shadows
from services.router.versions import ModelVersions, resolve_model, version_key

log = logging.getLogger(__name__)


class ModelSummary(NamedTuple):
    name: str
    version: str                 # the default version unpinned requests go to
    replicas: int                # healthy ones
    max_context: int
    versions: list[str]          # every version with a replica, natural order


class Routing(NamedTuple):
    model: str
    default_version: str
    canary: dict[str, float]     # version -> share of unpinned requests
    versions: list[str]          # served versions, natural order
    shadow: tuple[str, float] = ("", 0.0)       # (version, share) mirrored (shadow.py)
    shadow_stats: dict[str, float] | None = None


class ReplicaState(NamedTuple):
    replica: Replica
    breaker: str                 # closed | half_open | open
    isolation: str               # why level 1 isolated it; "" when it is not


class Admin:
    def __init__(self, table: ReplicaTable, versions: ModelVersions, failover: Failover, policy: AffinityRouter,
                 default_model: str, shadows: Shadows | None = None, lora: LoraAdapters | None = None):
        self.table, self.versions, self.failover, self.policy = table, versions, failover, policy
        self.shadows = shadows or Shadows()
        self.lora = lora
        self.default_model = default_model

    def resolve(self, model: str) -> str:
        """`name`, `name@version`, "" or a LoRA adapter's name -> the served model's name (NotFound otherwise)."""
        named = self.lora.resolve(model)[0] if self.lora is not None else model
        return resolve_model(named, "", self.default_model, self.table.models())[0]

    def max_context(self, model: str) -> int:
        """The longest context among `model`'s replicas (0 while none is known)."""
        return max((r.max_context for r in self.table.all() if r.model == model), default=0)

    def models(self) -> list[ModelSummary]:
        summaries = []
        for name in self.table.models():
            replicas = [r for r in self.table.all() if r.model == name]
            versions = sorted({r.model_version for r in replicas}, key=version_key)
            healthy = {r.model_version for r in self.table.serving(name)}
            default = self.versions.routing(name, healthy or versions).default
            summaries.append(ModelSummary(name, default, sum(r.healthy for r in replicas),
                                          max(r.max_context for r in replicas), versions))
        return summaries

    def routing(self, model: str) -> Routing:
        served = self._served(model)
        routing = self.versions.routing(model, served)
        stats = self.shadows.of(model, routing.shadow[0]).as_dict() if routing.shadow[0] else None
        return Routing(model, routing.default, dict(routing.canary), sorted(served, key=version_key), routing.shadow,
                       stats)

    def set_routing(self, model: str, default_version: str, canary: Mapping[str, float] | None,
                    shadow: tuple[str, float] | None = None) -> Routing:
        """Switch the default version and/or replace the canary shares (None: keep them).
        Requests already streaming keep their replica, so their version."""
        self.versions.set(model, self._served(model), default_version, canary, shadow)
        routing = self.routing(model)
        log.info("model %s: default version %s, canary %s", model, routing.default_version, routing.canary)
        return routing

    def replicas(self, now: float) -> list[ReplicaState]:
        breakers = self.failover.states(now)
        return [ReplicaState(r, str(breakers.get(r.replica_id, "closed")), self.failover.isolation(r.replica_id) or "")
                for r in self.table.all()]

    def load_entropy(self, now: float) -> float:
        return self.policy.load_entropy(now)

    def snapshot(self, now: float) -> metrics.Snapshot:
        """The replica table and breakers, for the gauges Prometheus reads when it scrapes."""
        replicas = [metrics.ReplicaSample(r.replica_id, r.model, r.model_version, r.region,
                                          r.healthy and self.failover.isolation(r.replica_id) is None,
                                          r.running, r.waiting, r.mem_ratio, r.weight) for r in self.table.all()]
        latency = self.failover.latency
        watched = {r.model for r in self.table.all()} if latency.enabled else set()
        return metrics.Snapshot(replicas, {rid: str(state) for rid, state in self.failover.states(now).items()},
                                {m: str(state) for m, state in self.failover.model_states(now).items()},
                                {m: (s.degrading, s.p95_s) for m in sorted(watched)
                                 for s in (latency.state(m, now),)})

    def _served(self, model: str) -> set[str]:
        """Versions with a replica, healthy or not (what routing may name)."""
        return {r.model_version for r in self.table.all() if r.model == model}
