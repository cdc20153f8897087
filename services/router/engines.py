"""The router's client of the engines: one channel per address, the Generate call, their info and load
reports, and the lifecycle calls (a version loaded, a drain, a LoRA adapter loaded or unloaded).

Protobuf stops here: an EngineRequest becomes the engine's GenerateRequest and each of its answers an
EngineReply (relay.py relays them), GetInfo becomes EngineInfo, each load report the plain LoadReport of
replicas.py, and `load_to_pb` is the way back (ListReplicas); LoadVersion answers a VersionLoad.  Each call
raises grpc.aio.AioRpcError when the engine fails it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from mesh.clients.values import TokenLogprob, TopLogprob
from mesh.grpcutil import channel
from mesh.sampling import Sampling
from mesh.sampling_pb import to_pb
from meshpb.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.router.replicas import LoadReport, TenantShare
from services.router.request import ABORT, BATCH, ERROR, LENGTH, STOP, Usage

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


@dataclass(frozen=True)
class EngineRequest:
    """One attempt's Generate on an engine (engine.proto's GenerateRequest)."""
    request_id: str
    model: str
    prompt_ids: Sequence[int]
    sampling: Sampling
    priority: str                          # request.py: interactive | batch
    resume_ids: Sequence[int]              # another replica's tokens already streamed (mid-stream failover)
    cache_salt: bytes
    cache_class: str
    tenant: str
    weight: float
    adapter: str = ""                      # a LoRA adapter to run with; "": the base model


@dataclass(frozen=True)
class EngineReply:
    """One message of an engine's Generate stream: new tokens; the last one has `finish_reason` and usage."""
    ids: tuple[int, ...]
    finish_reason: str = ""                # request.py's STOP, LENGTH, ABORT, ERROR; "": more follows
    usage: Usage = Usage()
    logprobs: tuple[TokenLogprob, ...] = ()          # each token's text "" (the router decodes it: relay.py)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    embedding: tuple[float, ...] = ()


_FINISH = {common_pb2.FINISH_REASON_UNSPECIFIED: "", common_pb2.FINISH_REASON_STOP: STOP,
           common_pb2.FINISH_REASON_LENGTH: LENGTH, common_pb2.FINISH_REASON_ABORT: ABORT,
           common_pb2.FINISH_REASON_ERROR: ERROR}


def request_to_pb(r: EngineRequest) -> engine_pb2.GenerateRequest:
    priority = common_pb2.PRIORITY_BATCH if r.priority == BATCH else common_pb2.PRIORITY_INTERACTIVE
    return engine_pb2.GenerateRequest(request_id=r.request_id, model=r.model, prompt_ids=r.prompt_ids,
                                      sampling=to_pb(r.sampling), priority=priority, resume_ids=r.resume_ids,
                                      cache_salt=r.cache_salt, cache_class=r.cache_class, tenant=r.tenant,
                                      weight=r.weight, adapter=r.adapter)


def logprobs_from_pb(entries: Iterable[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(e.token_id, e.token, e.logprob, tuple(TopLogprob(t.token_id, t.token, t.logprob)
                                                                    for t in e.top)) for e in entries)


def reply_from_pb(m: engine_pb2.GenerateResponse) -> EngineReply:
    u = m.usage
    return EngineReply(tuple(m.ids), _FINISH.get(m.finish_reason, ERROR),
                       Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
                       logprobs_from_pb(m.logprobs) if m.logprobs else (),
                       logprobs_from_pb(m.prompt_logprobs) if m.prompt_logprobs else (),
                       tuple(m.embedding))


class EngineStream:
    """One Generate call's answers as EngineReply, in order; `cancel()` ends the call (the engine aborts it)."""

    def __init__(self, call: Any):
        self._call = call
        self._messages = call.__aiter__()

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> EngineReply:
        return reply_from_pb(await self._messages.__anext__())

    def cancel(self) -> None:
        self._call.cancel()


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

    def generate(self, address: str, request: EngineRequest, metadata: Sequence[tuple[str, str]],
                 timeout: float | None) -> EngineStream:
        """Open the engine's Generate stream (`timeout`: the call's deadline; None: none)."""
        return EngineStream(self.stub(address).Generate(request_to_pb(request), metadata=tuple(metadata),
                                                        timeout=timeout))

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
