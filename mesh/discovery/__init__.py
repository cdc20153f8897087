"""Where every service is: one small interface, a static registry here, Consul in deployment."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Endpoint:
    """One service replica as discovery reports it."""

    service: str                  # "engine", "tokenizer", "cache", "router"
    replica_id: str
    address: str                  # host:port
    model: str = ""
    model_version: str = ""
    region: str = "local"
    meta: tuple[tuple[str, str], ...] = field(default=())


class StaticDiscovery:
    """The embedded registry for one machine: the launcher names every replica up front."""

    def __init__(self, endpoints: list[Endpoint]):
        self._endpoints = list(endpoints)

    def endpoints(self, service: str) -> list[Endpoint]:
        return [e for e in self._endpoints if e.service == service]


def parse_endpoint(service: str, spec: str) -> Endpoint:
    """`ID=HOST:PORT` or `HOST:PORT` (the id then is the address)."""
    replica_id, _, address = spec.rpartition("=")
    if not address or ":" not in address:
        raise ValueError(f"{service} endpoint {spec!r} must look like ID=HOST:PORT")
    return Endpoint(service, replica_id or address, address)
