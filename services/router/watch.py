"""ReplicaWatch: keeps the replica table true to the engines, and knows whether the router is ready.

Replicas come from discovery (static: the launcher's list; Consul: whatever passes its checks).
Each gets a health/info probe every `probe_interval_s` (judged by failover's ProbeVerdicts) and a
stream of load reports.  The router becomes ready once the tokenizer is healthy and every expected
engine (RouterConfig.expected_engines) has been healthy at once, so requests sent right after the
edge's /health says 200 spread over all of them; after that it stays ready while the tokenizer and
at least one engine are healthy, so the edge's /health reflects the mesh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from mesh.discovery import make_discovery
from mesh.grpcutil import check_health
from services.router.config import RouterConfig
from services.router.engines import Engines
from services.router.failover import Failover, ProbeVerdicts
from services.router.replicas import Replica, ReplicaTable

log = logging.getLogger(__name__)


class ReplicaWatch:
    def __init__(self, config: RouterConfig, table: ReplicaTable, failover: Failover, engines: Engines,
                 on_tokenizers: Callable[[list[bool]], None] = lambda healthy: None):
        self.config, self.table, self.failover, self.engines = config, table, failover, engines
        self.on_tokenizers = on_tokenizers     # each tokenizer replica's probe, in --tokenizer order
        self.discovery = make_discovery(config.discovery, config.engines)
        self.verdicts = ProbeVerdicts(config.unhealthy_after)
        self.tokenizer_healthy = False
        self.complete = False         # every expected engine has been healthy at once
        self._load_watchers: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, report_ready: Callable[[bool], Awaitable[None]] | None = None) -> None:
        """Probe once, then in the background: follow discovery, probe every interval and, when
        given, report readiness every interval (the server's health status)."""
        await self.probe_all()
        self._tasks = [asyncio.create_task(self._probe_every_interval()),
                       asyncio.create_task(self.follow_discovery())]
        if report_ready is not None:
            self._tasks.append(asyncio.create_task(self._report_every_interval(report_ready)))

    async def close(self) -> None:
        for task in [*self._tasks, *self._load_watchers.values()]:
            task.cancel()
        await self.discovery.close()

    def ready(self) -> bool:
        healthy = sum(r.healthy for r in self.table.all())
        if not self.complete and healthy >= self.config.expected_engines:
            self.complete = True
            log.info("all %d expected engine(s) are healthy", self.config.expected_engines)
        return self.tokenizer_healthy and healthy > 0 and self.complete

    async def follow_discovery(self) -> None:
        async for endpoints in self.discovery.watch("engine"):
            added, removed = self.table.sync(endpoints)
            for replica in removed:
                log.info("replica %s (%s) left", replica.replica_id, replica.address)
                self.failover.forget(replica.replica_id)
                self.verdicts.forget(replica.replica_id)
                watcher = self._load_watchers.pop(replica.replica_id, None)
                if watcher is not None:
                    watcher.cancel()
            for replica in added:
                log.info("replica %s (%s, weight %g) joined", replica.replica_id, replica.address, replica.weight)
                await self.probe(replica)
                self._load_watchers[replica.replica_id] = asyncio.create_task(self.follow_load(replica))

    async def follow_load(self, replica: Replica) -> None:
        """Apply the engine's load reports (WatchLoad) as they come; reconnect after failures."""
        while True:
            try:
                async for report in self.engines.loads(replica.address, self.config.load_interval_ms):
                    replica.apply_load(report, time.monotonic())
            except grpc.aio.AioRpcError:
                pass                            # the health probe marks the replica; retry below
            await asyncio.sleep(self.config.probe_interval_s)

    async def probe(self, replica: Replica) -> None:
        """One health check (and, until it answers once, GetInfo), judged by ProbeVerdicts."""
        checked_at = time.monotonic()
        answered = await check_health(replica.address)
        self.failover.health_checked(replica.replica_id, answered, checked_at)
        if answered and not replica.model:
            try:
                info = await self.engines.info(replica.address)
            except grpc.aio.AioRpcError:
                answered = False
            else:
                replica.model, replica.model_version = info.model, info.model_version
                replica.region, replica.max_context = info.region, info.max_context
                replica.max_waiting = info.max_waiting
                self.table.block_size = info.block_size or self.table.block_size
        healthy = self.verdicts.judge(replica.replica_id, answered, replica.healthy)
        if healthy != replica.healthy:
            log.info("replica %s (%s) is now %s", replica.replica_id, replica.address,
                     "healthy" if healthy else "unhealthy")
        replica.healthy = healthy

    async def probe_all(self) -> None:
        tokenizers = await asyncio.gather(*(check_health(a) for a in self.config.tokenizer.split(",") if a))
        self.tokenizer_healthy = any(tokenizers)
        self.on_tokenizers(list(tokenizers))
        await asyncio.gather(*(self.probe(r) for r in self.table.all()))

    async def _probe_every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            await self.probe_all()

    async def _report_every_interval(self, report_ready: Callable[[bool], Awaitable[None]]) -> None:
        while True:
            await report_ready(self.ready())
            await asyncio.sleep(self.config.probe_interval_s)
