"""Where every service is: one small interface, a static registry on one machine, Consul in deployment.

A service announces itself with `register(endpoint, check)` once it serves and `deregister(replica_id)`
when it stops; the router follows the engines with `watch("engine")`, which yields the whole current
list each time it changes, and reads `endpoints("engine")` (the last list seen, no I/O) in between.
`make_discovery("static" | "consul")` picks the backend; the Consul one (and `requests` with it) is
imported only by the processes that ask for it.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field


class DiscoveryError(Exception):
    """The registry cannot be reached or refused a request; the message says what to do."""


@dataclass(frozen=True)
class Endpoint:
    """One service replica as discovery reports it."""

    service: str                  # "engine", "tokenizer", "cache", "router", "edge"
    replica_id: str
    address: str                  # host:port ([v6]:port for IPv6)
    model: str = ""
    model_version: str = ""
    region: str = "local"
    meta: tuple[tuple[str, str], ...] = field(default=())   # sorted extra key/value pairs
    tags: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class HealthCheck:
    """How the registry probes a replica: the gRPC health service or an HTTP URL that answers 2xx."""

    kind: str                     # "grpc" or "http"
    target: str                   # grpc: host:port (host:port/service checks one service); http: a URL
    interval_s: float = 2.0
    timeout_s: float = 1.0
    deregister_after_s: float = 60.0   # a replica critical this long is removed (Consul's minimum is 1m)

    def __post_init__(self) -> None:
        if self.kind not in ("grpc", "http"):
            raise ValueError(f"health check kind {self.kind!r} is not grpc or http")
        if self.kind == "http" and not self.target.startswith(("http://", "https://")):
            raise ValueError(f"an http health check needs a URL, not {self.target!r}")
        if self.kind == "grpc":
            split_address(self.target.partition("/")[0])
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.deregister_after_s <= 0:
            raise ValueError("health check interval, timeout and deregister_after must be positive")

    @classmethod
    def grpc(cls, address: str, **kw: float) -> HealthCheck:
        return cls("grpc", address, **kw)

    @classmethod
    def http(cls, url: str, **kw: float) -> HealthCheck:
        return cls("http", url, **kw)


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


def split_address(address: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r} must look like HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"IPv6 address {address!r} needs brackets: [HOST]:PORT")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoint(service: str, spec: str) -> Endpoint:
    """`ID=HOST:PORT` or `HOST:PORT` (the id then is the address)."""
    replica_id, _, address = spec.rpartition("=")
    if not address or ":" not in address:
        raise ValueError(f"{service} endpoint {spec!r} must look like ID=HOST:PORT")
    return Endpoint(service, replica_id or address, address)


def advertise_address(host: str, port: int, advertise: str = "") -> str:
    """The address other hosts reach this process at: `advertise` (HOST or HOST:PORT) when given,
    else the bind host, else (bound to every interface) this host's name."""
    if advertise:
        try:
            split_address(advertise)          # HOST:PORT already
            return advertise
        except ValueError:
            return join_address(advertise.strip("[]"), port)
    if host in ("0.0.0.0", "::", ""):
        import socket

        host = socket.getfqdn()
    return join_address(host, port)


def load_endpoints(path: str) -> list[Endpoint]:
    """A static discovery file: a JSON list of {"service", "replica_id", "address", "region"?,
    "model"?, "model_version"?} objects, e.g. the engines of every region on a fixed set of hosts."""
    import json
    from pathlib import Path

    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"discovery file {path}: {exc}") from None
    if not isinstance(entries, list):
        raise ValueError(f"discovery file {path}: expected a JSON list of endpoints")
    endpoints = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not {"service", "replica_id", "address"} <= set(e):
            raise ValueError(f"discovery file {path}: entry {i} needs service, replica_id and address")
        unknown = set(e) - {"service", "replica_id", "address", "region", "model", "model_version"}
        if unknown:
            raise ValueError(f"discovery file {path}: entry {i} has unknown field(s) {', '.join(sorted(unknown))}")
        split_address(str(e["address"]))
        endpoints.append(Endpoint(str(e["service"]), str(e["replica_id"]), str(e["address"]),
                                  model=str(e.get("model", "")), model_version=str(e.get("model_version", "")),
                                  region=str(e.get("region", "local"))))
    return endpoints


BACKENDS = ("static", "consul")


def make_discovery(kind: str, endpoints: Sequence[Endpoint] = ()) -> Discovery:
    """The backend named by `--discovery`: "static" serves `endpoints`; "consul" talks to the agent at
    CONSUL_HTTP_ADDR (token from CONSUL_HTTP_TOKEN) and ignores `endpoints`."""
    if kind == "static":
        return StaticDiscovery(endpoints)
    if kind == "consul":
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


from mesh.discovery.static import StaticDiscovery  # noqa: E402  (static.py subclasses Discovery above)

__all__ = ["BACKENDS", "Discovery", "DiscoveryError", "Endpoint", "HealthCheck", "StaticDiscovery",
           "advertise_address", "announce", "load_endpoints",
           "join_address", "make_discovery", "parse_endpoint", "split_address"]
