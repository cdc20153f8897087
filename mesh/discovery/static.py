"""The embedded registry for one machine: the launcher names every replica up front."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from mesh.discovery.backend import Discovery
from mesh.discovery.endpoint import Endpoint, HealthCheck


class StaticDiscovery(Discovery):
    """The launcher's list.  Nothing registers (the launcher already knows every address), and health
    is the router's own probes' business; an operator changes the list at runtime through the router's
    admin RPCs (`add`, `remove`: a replica added by hand, or drained), and every `watch` sees it."""

    def __init__(self, endpoints: Sequence[Endpoint] = ()):
        self._endpoints = sorted(endpoints, key=lambda e: (e.service, e.replica_id))
        self._changed = asyncio.Condition()
        self._generation = 0           # bumped by every change: a watcher busy elsewhere misses none

    async def add(self, endpoint: Endpoint) -> None:
        """Add (or replace, by replica id) an endpoint."""
        kept = [e for e in self._endpoints if (e.service, e.replica_id) != (endpoint.service, endpoint.replica_id)]
        await self._set([*kept, endpoint])

    async def remove(self, service: str, replica_id: str) -> bool:
        kept = [e for e in self._endpoints if (e.service, e.replica_id) != (service, replica_id)]
        found = len(kept) != len(self._endpoints)
        await self._set(kept)
        return found

    async def _set(self, endpoints: list[Endpoint]) -> None:
        async with self._changed:
            self._endpoints = sorted(endpoints, key=lambda e: (e.service, e.replica_id))
            self._generation += 1
            self._changed.notify_all()

    async def register(self, endpoint: Endpoint, check: HealthCheck | None = None) -> None:
        pass

    async def deregister(self, replica_id: str) -> None:
        pass

    async def close(self) -> None:
        pass

    def endpoints(self, service: str) -> list[Endpoint]:
        return [e for e in self._endpoints if e.service == service]

    async def watch(self, service: str) -> AsyncIterator[list[Endpoint]]:
        last, seen = self.endpoints(service), self._generation
        yield last
        while True:                    # until cancelled
            async with self._changed:
                await self._changed.wait_for(lambda seen=seen: self._generation != seen)  # type: ignore[misc]
                seen = self._generation
            now = self.endpoints(service)
            if now != last:
                last = now
                yield now
