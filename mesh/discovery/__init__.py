"""Where every service is: one small interface, a static registry on one machine, Consul in deployment.

A service announces itself with `register(endpoint, check)` once it serves and `deregister(replica_id)`
when it stops; the router follows the engines with `watch("engine")`, which yields the whole current
list each time it changes, and reads `endpoints("engine")` (the last list seen, no I/O) in between.
`make_discovery("static" | "consul")` picks the backend; the Consul one (and `requests` with it) is
imported only by the processes that ask for it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from mesh.discovery.backend import Discovery, DiscoveryError
from mesh.discovery.endpoint import (
    Endpoint,
    HealthCheck,
    advertise_address,
    join_address,
    load_endpoints,
    parse_endpoint,
    split_address,
)
from mesh.discovery.static import StaticDiscovery

BACKENDS = ("static", "consul")


def make_discovery(kind: str, endpoints: Sequence[Endpoint] = ()) -> Discovery:
    """The backend named by `--discovery`: "static" serves `endpoints`; "consul" talks to the agent at
    CONSUL_HTTP_ADDR (token from CONSUL_HTTP_TOKEN) and ignores `endpoints`."""
    if kind == "static":
        return StaticDiscovery(endpoints)
    if kind == "consul":
        # Imported here, not above: python-consul and requests load only in processes that use Consul.
        from mesh.discovery.consul import ConsulDiscovery

        return ConsulDiscovery.from_env()
    raise ValueError(f"discovery {kind!r} is not one of {', '.join(BACKENDS)}")


async def announce(kind: str, endpoint: Endpoint, check: HealthCheck | None = None
                   ) -> Callable[[], Awaitable[None]]:
    """Register a serving process with the `kind` registry (a no-op for static); returns the
    coroutine function that withdraws it, for the process's shutdown path.  Raises DiscoveryError
    when the registry cannot be reached, so a misconfigured process fails at start, not later."""
    registry = make_discovery(kind)
    await registry.register(endpoint, check)

    async def withdraw() -> None:
        await registry.deregister(endpoint.replica_id)
        await registry.close()

    return withdraw


__all__ = ["BACKENDS", "Discovery", "DiscoveryError", "Endpoint", "HealthCheck", "StaticDiscovery",
           "advertise_address", "announce", "load_endpoints",
           "join_address", "make_discovery", "parse_endpoint", "split_address"]
