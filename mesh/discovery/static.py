"""The embedded registry for one machine: the launcher names every replica up front."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from mesh.discovery.backend import Discovery
from mesh.discovery.endpoint import Endpoint, HealthCheck


class StaticDiscovery(Discovery):
    """A fixed list. Nothing registers (the launcher already knows every address), and health is
    the router's own probes' business, so the list never changes while the mesh runs."""

    def __init__(self, endpoints: Sequence[Endpoint] = ()):
        self._endpoints = sorted(endpoints, key=lambda e: (e.service, e.replica_id))

    async def register(self, endpoint: Endpoint, check: HealthCheck | None = None) -> None:
        pass

    async def deregister(self, replica_id: str) -> None:
        pass

    async def close(self) -> None:
        pass

    def endpoints(self, service: str) -> list[Endpoint]:
        return [e for e in self._endpoints if e.service == service]

    async def watch(self, service: str) -> AsyncIterator[list[Endpoint]]:
        yield self.endpoints(service)
        await asyncio.Event().wait()   # nothing will change; wait until cancelled
