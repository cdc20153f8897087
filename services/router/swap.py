"""Replica lifecycle from the router: a model version hot-swapped on every replica of a model
(LoadModelVersion), a replica drained (DrainReplica) or added by hand (AddReplica, static discovery).

One replica at a time, so the others keep their whole capacity while it loads: each engine loads
the weights beside its running ones and, with activate, starts new requests on them while its
requests in flight finish on theirs (services/engine/runtime/versions.py).  The replica table follows each
engine's answer at once (its probes would within a second), and once every replica runs the new
version, it becomes the model's default.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import grpc

from mesh.discovery import Discovery, Endpoint, StaticDiscovery
from mesh.errors import FailedPrecondition, InvalidArgument, NotFound
from services.router.engines import Engines
from services.router.replicas import ReplicaTable
from services.router.upstream import relay_error

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0


class Loaded(NamedTuple):
    replica_id: str
    active_version: str
    loaded_versions: tuple[str, ...]
    load_seconds: float


async def load_everywhere(table: ReplicaTable, engines: Engines, model: str, version: str, source: str,
                          activate: bool) -> list[Loaded]:
    replicas = [r for r in table.all() if r.model == model]
    if not replicas:
        raise NotFound(f"model {model!r} has no replicas to load version {version!r} on")
    done: list[Loaded] = []
    for replica in sorted(replicas, key=lambda r: r.replica_id):
        try:
            reply = await engines.load_version(replica.address, version, source, activate, LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            raise relay_error(f"engine {replica.replica_id} (after {len(done)} of {len(replicas)} replicas "
                              f"took version {version})", err) from None
        replica.model_version = reply.active_version
        done.append(Loaded(replica.replica_id, reply.active_version, reply.loaded_versions, reply.load_seconds))
        log.info("replica %s: version %s loaded in %.1f s (active %s)", replica.replica_id, version,
                 reply.load_seconds, reply.active_version)
    return done


async def drain(table: ReplicaTable, engines: Engines, discovery: Discovery, replica_id: str) -> int:
    """No new request goes to the replica; its engine finishes its calls and leaves discovery (Consul),
    or this router drops it (static).  Returns the calls that were in flight on the engine."""
    replica = table.get(replica_id)
    if replica is None:
        raise NotFound(f"replica {replica_id!r} does not exist; known: {', '.join(r.replica_id for r in table.all())}")
    replica.draining = True
    try:
        finished = await engines.drain(replica.address, LOAD_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        replica.draining = False
        raise relay_error(f"engine {replica_id}", err) from None
    if isinstance(discovery, StaticDiscovery):
        await discovery.remove("engine", replica_id)
    log.info("replica %s drained (%d call(s) finished) and left", replica_id, finished)
    return finished


async def add(discovery: Discovery, replica_id: str, address: str, region: str) -> None:
    if not isinstance(discovery, StaticDiscovery):
        raise FailedPrecondition("with Consul, engines register themselves; start the engine with --discovery consul")
    if not replica_id or not address or ":" not in address:
        raise InvalidArgument("give replica_id and address (HOST:PORT)")
    await discovery.add(Endpoint("engine", replica_id, address, region=region or "local"))
    log.info("replica %s (%s) added", replica_id, address)
