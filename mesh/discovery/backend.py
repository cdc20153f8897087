"""The registry contract every discovery backend implements (static.py, consul.py)."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator

from mesh.discovery.endpoint import Endpoint, HealthCheck


class DiscoveryError(Exception):
    """The registry cannot be reached or refused a request; the message says what to do."""


class Discovery(abc.ABC):
    """The registry contract, shared by the static and the Consul backends.

    - `register` announces `endpoint` with `check`; registering the same replica_id again replaces it.
    - `deregister` removes a replica this process registered; it never raises, so a stopping process
      cannot fail on it (Consul also drops a replica whose check stays critical past deregister_after).
    - `endpoints(service)` is a snapshot without I/O: the replicas the registry last reported as
      passing their checks (Consul: only for services that a running `watch` follows).
    - `watch(service)` yields the full, sorted list now and again each time it changes; it survives
      registry outages (keeping the last list) and ends only when cancelled.
    """

    @abc.abstractmethod
    async def register(self, endpoint: Endpoint, check: HealthCheck | None = None) -> None:
        """Announce `endpoint`; `check` defaults to a gRPC health check of its address."""

    @abc.abstractmethod
    async def deregister(self, replica_id: str) -> None:
        """Withdraw a replica registered through this object."""

    @abc.abstractmethod
    def endpoints(self, service: str) -> list[Endpoint]:
        """The replicas of `service` last known to pass their checks, sorted by replica_id."""

    @abc.abstractmethod
    def watch(self, service: str) -> AsyncIterator[list[Endpoint]]:
        """Yield the replicas of `service` (sorted by replica_id) now and after every change."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; registrations are left alone (call deregister first)."""
