"""What discovery hands around: a replica's Endpoint, the HealthCheck the registry runs on it, and
the address forms the flags and the static discovery file use."""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass, field
from pathlib import Path


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
    # Its share of new requests relative to the others (weighted round-robin; the router's policies
    # divide load by it): 1 by default; 0 is a standby that takes new requests only while no replica
    # of weight > 0 is admitted.  Consul: Meta "weight"; the static file: "weight".
    weight: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight", check_weight(self.weight, f"{self.service} {self.replica_id}"))


def check_weight(weight: object, what: str) -> float:
    """`weight` as a float if it is a finite number >= 0; ValueError naming `what` otherwise."""
    try:
        value = float(weight)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{what}: weight {weight!r} is not a number") from None
    if isinstance(weight, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what}: weight {weight!r} must be a finite number >= 0 (0: standby)")
    return value


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
        host = socket.getfqdn()
    return join_address(host, port)


def load_endpoints(path: str) -> list[Endpoint]:
    """A static discovery file: a JSON list of {"service", "replica_id", "address", "region"?,
    "model"?, "model_version"?, "weight"?} objects, e.g. the engines of every region on a fixed set of
    hosts; "weight" is a number >= 0 (default 1; see Endpoint.weight)."""
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
        unknown = set(e) - {"service", "replica_id", "address", "region", "model", "model_version", "weight"}
        if unknown:
            raise ValueError(f"discovery file {path}: entry {i} has unknown field(s) {', '.join(sorted(unknown))}")
        split_address(str(e["address"]))
        weight = check_weight(e.get("weight", 1.0), f"discovery file {path}: entry {i} ({e['replica_id']})")
        endpoints.append(Endpoint(str(e["service"]), str(e["replica_id"]), str(e["address"]),
                                  model=str(e.get("model", "")), model_version=str(e.get("model_version", "")),
                                  region=str(e.get("region", "local")), weight=weight))
    return endpoints
