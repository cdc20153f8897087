"""The router's table of engine replicas, fed by discovery and health/info probes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Replica:
    replica_id: str
    address: str
    model: str = ""
    model_version: str = ""
    region: str = "local"
    max_context: int = 0
    healthy: bool = False
    in_flight: int = 0


class ReplicaTable:
    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}

    def upsert(self, replica: Replica) -> Replica:
        existing = self._replicas.get(replica.replica_id)
        if existing is None:
            self._replicas[replica.replica_id] = replica
            return replica
        existing.address = replica.address
        return existing

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def all(self) -> list[Replica]:
        return sorted(self._replicas.values(), key=lambda r: r.replica_id)

    def serving(self, model: str) -> list[Replica]:
        return [r for r in self.all() if r.healthy and r.model == model]

    def models(self) -> list[str]:
        return sorted({r.model for r in self._replicas.values() if r.model})
