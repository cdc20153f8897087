"""The router's client of the engines: one channel per address, their info and load reports, and
the lifecycle calls (a version loaded, a drain, a LoRA adapter loaded or unloaded).

Protobuf stops here for what the router keeps: GetInfo becomes EngineInfo, each load report
the plain LoadReport of replicas.py, and `load_to_pb` is the way back (ListReplicas); LoadVersion
answers a VersionLoad.  The Generate stream itself is relayed by relay.py on `stub()`.  Each call
raises grpc.aio.AioRpcError when the engine fails it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import fields
from typing import NamedTuple

from mesh.grpcutil import channel
from meshpb.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.router.replicas import LoadReport, TenantShare

LISTS = ("tenants", "adapters", "adapter_paths")     # converted apart from the plain fields


class EngineInfo(NamedTuple):
    """What the router needs of an engine's GetInfo."""

    model: str
    model_version: str
    region: str
    max_context: int
    block_size: int
    max_waiting: int = 0           # the engine's queue bound; 0: not reported


def load_from_pb(report: common_pb2.LoadReport) -> LoadReport:
    """meshpb.v1.LoadReport -> LoadReport (field names are the same on both sides)."""
    values = {f.name: getattr(report, f.name) for f in fields(LoadReport) if f.name not in LISTS}
    tenants = tuple(TenantShare(t.tenant, t.running, t.waiting, t.tokens) for t in report.tenants)
    return LoadReport(**values, tenants=tenants, adapters=tuple(report.adapters),
                      adapter_paths=tuple(report.adapter_paths))


def load_to_pb(replica_id: str, load: LoadReport) -> common_pb2.LoadReport:
    """LoadReport -> meshpb.v1.LoadReport, naming the replica it describes."""
    values = {f.name: getattr(load, f.name) for f in fields(LoadReport) if f.name not in LISTS}
    return common_pb2.LoadReport(replica_id=replica_id, **values, adapters=list(load.adapters),
                                 adapter_paths=list(load.adapter_paths),
                                 tenants=[common_pb2.TenantLoad(**t._asdict()) for t in load.tenants])


class VersionLoad(NamedTuple):
    """An engine's answer to LoadVersion."""

    active_version: str
    loaded_versions: tuple[str, ...]
    load_seconds: float


class Engines:
    def __init__(self) -> None:
        self._stubs: dict[str, engine_pb2_grpc.EngineStub] = {}

    def stub(self, address: str) -> engine_pb2_grpc.EngineStub:
        """The engine at `address`; one channel per address, kept for the router's life."""
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = engine_pb2_grpc.EngineStub(channel(address))
        return stub

    async def info(self, address: str, timeout: float = 2.0) -> EngineInfo:
        """Raises grpc.aio.AioRpcError when the engine does not answer."""
        info = await self.stub(address).GetInfo(engine_pb2.EngineInfoRequest(), timeout=timeout)
        return EngineInfo(info.model, info.model_version, info.region, info.max_context, info.block_size,
                          info.max_waiting)

    async def loads(self, address: str, interval_ms: int) -> AsyncIterator[LoadReport]:
        """The engine's load reports as it sends them (WatchLoad), until the stream fails
        (grpc.aio.AioRpcError) or the caller stops reading."""
        call = self.stub(address).WatchLoad(engine_pb2.LoadRequest(interval_ms=interval_ms))
        try:
            async for report in call:
                yield load_from_pb(report)
        finally:
            call.cancel()

    async def load_version(self, address: str, version: str, folder: str, activate: bool,
                           timeout: float) -> VersionLoad:
        reply = await self.stub(address).LoadVersion(
            engine_pb2.LoadVersionRequest(version=version, folder=folder, activate=activate), timeout=timeout)
        return VersionLoad(reply.active_version, tuple(reply.loaded_versions), reply.load_seconds)

    async def drain(self, address: str, timeout: float) -> int:
        """The engine takes no new request and finishes its calls; returns how many there were."""
        reply = await self.stub(address).Drain(engine_pb2.DrainRequest(), timeout=timeout)
        return int(reply.finished)

    async def load_adapter(self, address: str, name: str, path: str, timeout: float) -> float:
        """Returns the seconds the load took."""
        reply = await self.stub(address).LoadAdapter(engine_pb2.LoadAdapterRequest(name=name, path=path),
                                                     timeout=timeout)
        return float(reply.load_seconds)

    async def unload_adapter(self, address: str, name: str, timeout: float) -> None:
        await self.stub(address).UnloadAdapter(engine_pb2.UnloadAdapterRequest(name=name), timeout=timeout)
