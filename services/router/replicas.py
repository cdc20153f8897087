"""The router's table of engine replicas, fed by discovery, health/info probes and load reports.

A Replica carries two kinds of load state: what its engine last reported (a LoadReport,
stale by up to one report interval) and the router's own `in_flight` count, which is exact
and changes the moment a request is routed.  Policies read both; see `queued`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from mesh.discovery import Endpoint


class TenantShare(NamedTuple):
    """One tenant's requests on an engine (its load report, busiest tenants first)."""

    tenant: str
    running: int
    waiting: int
    tokens: int          # computed for it since the engine started


@dataclass(frozen=True)
class LoadReport:
    """An engine's view of its own load: meshpb.v1.LoadReport as plain values (engines.py converts)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0          # free or evictable (cached, unreferenced) blocks
    qps: float = 0.0                 # requests finished per second over the engine's recent window
    p50_latency_ms: float = 0.0      # 0: no request finished in the window
    p99_latency_ms: float = 0.0
    tokens_per_second: float = 0.0
    unix_ms: int = 0                 # the engine's wall clock when it wrote the report
    tenants: tuple[TenantShare, ...] = ()
    adapters: tuple[str, ...] = ()   # the LoRA adapters it holds
    adapter_paths: tuple[str, ...] = ()   # their folders, in the same order


@dataclass
class Replica:
    replica_id: str
    address: str
    model: str = ""
    model_version: str = ""
    region: str = "local"
    max_context: int = 0
    max_waiting: int = 0             # the engine's queue bound (GetInfo); 0: not reported
    healthy: bool = False
    in_flight: int = 0               # routed by this router and not finished: exact, never stale
    draining: bool = False           # an operator drains it: no new requests (services/router/swap.py)
    # Discovery's weight (Endpoint.weight): the policies give it new requests in proportion, and divide
    # its load by it; 0: a standby, picked only while no candidate of weight > 0 is (policies/weighted.py).
    weight: float = 1.0
    # The last LoadReport; kv_blocks_total == 0 means none has arrived yet.
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    qps: float = 0.0
    p50_latency_ms: float = 0.0
    p99_latency_ms: float = 0.0
    tokens_per_second: float = 0.0
    unix_ms: int = 0
    tenants: tuple[TenantShare, ...] = ()
    adapters: dict[str, str] = field(default_factory=dict)   # LoRA adapter -> its folder, as reported
    load_at: float | None = None     # router's monotonic time when the last report was applied
    # Fair scheduling: this router's requests in flight per tenant (the report's `tenants` are the engine's).
    tenant_in_flight: Counter[str] = field(default_factory=Counter)

    def apply_load(self, report: LoadReport, now: float) -> None:
        self.running, self.waiting = report.running, report.waiting
        self.kv_blocks_total, self.kv_blocks_free = report.kv_blocks_total, report.kv_blocks_free
        self.qps, self.tokens_per_second = report.qps, report.tokens_per_second
        self.p50_latency_ms, self.p99_latency_ms = report.p50_latency_ms, report.p99_latency_ms
        self.unix_ms, self.tenants = report.unix_ms, report.tenants
        self.adapters = dict(zip(report.adapters, report.adapter_paths, strict=False))
        self.load_at = now

    def tenant_load(self, tenant: str) -> int:
        """`tenant`'s requests on this replica: the engine's last count, or this router's own when higher."""
        reported = next((t.running + t.waiting for t in self.tenants if t.tenant == tenant), 0)
        return max(self.tenant_in_flight[tenant], reported)

    @property
    def load(self) -> LoadReport:
        """The last load report applied (all zeros before the first)."""
        return LoadReport(self.running, self.waiting, self.kv_blocks_total, self.kv_blocks_free, self.qps,
                          self.p50_latency_ms, self.p99_latency_ms, self.tokens_per_second, self.unix_ms,
                          self.tenants, tuple(self.adapters), tuple(self.adapters.values()))

    @property
    def mem_ratio(self) -> float:
        """Fraction of KV blocks held by running requests (cached-but-evictable blocks count as free)."""
        if self.kv_blocks_total <= 0:
            return 0.0
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total

    @property
    def outstanding(self) -> int:
        """in_flight + waiting: the load measure of least_load and balancing.

        With one router, in_flight already includes the engine's queue, so queued requests
        weigh twice: deliberately, because those are the ones that wait.  With several routers
        `waiting` is the only sign of the others' requests."""
        return self.in_flight + self.waiting

    @property
    def queued(self) -> int:
        """Estimated requests waiting at the engine now.

        The report's `waiting` is up to one interval old; in_flight - running counts what
        this router sent since, so a burst of picks is seen before the next report."""
        return max(self.waiting, self.in_flight - self.running)


class ReplicaTable:
    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}
        self.block_size = 16       # the engines' KV block size (GetInfo), which prefix hashes are cut by

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def all(self) -> list[Replica]:
        return sorted(self._replicas.values(), key=lambda r: r.replica_id)

    def serving(self, model: str) -> list[Replica]:
        return [r for r in self.all() if r.healthy and r.model == model]

    def models(self) -> list[str]:
        return sorted({r.model for r in self._replicas.values() if r.model})

    def sync(self, endpoints: Sequence[Endpoint]) -> tuple[list[Replica], list[Replica]]:
        """Make the table match discovery's list of engines; returns (added, removed).

        A replica that left is dropped from routing at once; its in-flight streams hold their
        own reference and finish (or fail over) on their own.  A new weight for a known replica
        at the same address applies in place (neither added nor removed: its state stays)."""
        wanted = {e.replica_id: e for e in endpoints}
        removed = [r for rid, r in list(self._replicas.items()) if rid not in wanted]
        for replica in removed:
            del self._replicas[replica.replica_id]
        added = []
        for e in endpoints:
            known = self._replicas.get(e.replica_id)
            if known is None or known.address != e.address:
                if known is not None:
                    removed.append(known)
                replica = self._replicas[e.replica_id] = Replica(e.replica_id, e.address, region=e.region,
                                                                 weight=e.weight)
                added.append(replica)
            elif known.weight != e.weight:
                known.weight = e.weight
        return added, removed
