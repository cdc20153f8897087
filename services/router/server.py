"""Router gRPC servicer: tokenize, pick a replica, relay the engine's stream as text deltas.

No policy lives here: the choice is the policy's (services/router/policies), the stop-string
logic is StopMatcher's; this file converts protobuf and moves bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from mesh.detokenize import IncrementalDecoder
from mesh.errors import InvalidArgument, NotFound, Unavailable
from mesh.grpcutil import channel, check_health, rpc_errors
from mesh.telemetry import outgoing_metadata, server_span
from meshpb.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.router.config import RouterConfig
from services.router.policies import POLICIES
from services.router.replicas import Replica, ReplicaTable
from services.router.stops import StopMatcher

log = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig):
        self.config = config
        self.table = ReplicaTable()
        for e in config.engines:
            self.table.upsert(Replica(e.replica_id, e.address, region=e.region))
        self.policy = POLICIES[config.policy]()
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(channel(config.tokenizer))
        self._engine_stubs: dict[str, engine_pb2_grpc.EngineStub] = {}
        self.tokenizer_healthy = False
        self._decoders: dict[str, Callable[[Sequence[int]], str]] = {}

    # -- replica state -----------------------------------------------------------------
    def engine_stub(self, replica: Replica) -> engine_pb2_grpc.EngineStub:
        stub = self._engine_stubs.get(replica.address)
        if stub is None:
            stub = self._engine_stubs[replica.address] = engine_pb2_grpc.EngineStub(channel(replica.address))
        return stub

    async def probe(self, replica: Replica) -> None:
        healthy = await check_health(replica.address)
        if healthy and not replica.model:
            try:
                info = await self.engine_stub(replica).GetInfo(engine_pb2.EngineInfoRequest(), timeout=2.0)
            except grpc.aio.AioRpcError:
                healthy = False
            else:
                replica.model, replica.model_version = info.model, info.model_version
                replica.region, replica.max_context = info.region, info.max_context
        if healthy != replica.healthy:
            log.info("replica %s (%s) is now %s", replica.replica_id, replica.address,
                     "healthy" if healthy else "unhealthy")
        replica.healthy = healthy

    async def probe_all(self) -> None:
        self.tokenizer_healthy = await check_health(self.config.tokenizer)
        await asyncio.gather(*(self.probe(r) for r in self.table.all()))

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            await self.probe_all()

    def ready(self) -> bool:
        return self.tokenizer_healthy and any(r.healthy for r in self.table.all())

    async def decode_fn(self, model: str) -> Callable[[Sequence[int]], str]:
        """ids -> text for `model`, from the tokenizer service's `tokenizers` JSON, fetched once.

        Streams are detokenized here, in process: a round trip to the tokenizer per token
        cost more CPU than the decode itself on a busy machine."""
        decode = self._decoders.get(model)
        if decode is None:
            from tokenizers import Tokenizer

            try:
                spec = await self.tokenizer.GetTokenizerJson(tokenizer_pb2.ModelInfoRequest(model=model), timeout=30.0)
            except grpc.aio.AioRpcError as err:
                raise _relay_error("tokenizer", err) from None
            tokenizer = Tokenizer.from_str(spec.tokenizer_json)

            def decode(ids: Sequence[int]) -> str:
                return str(tokenizer.decode(list(ids), skip_special_tokens=True))

            self._decoders[model] = decode
        return decode

    # -- request path ------------------------------------------------------------------
    def resolve_model(self, model: str) -> str:
        name = model if model and model != "default" else self.config.default_model
        if name not in self.table.models():
            known = ", ".join(self.table.models()) or "none yet"
            raise NotFound(f"model {name!r} is not served; available: {known}")
        return name

    def pick(self, model: str, pinned: str) -> Replica:
        if pinned:
            replica = self.table.get(pinned)
            if replica is None:
                raise NotFound(f"replica {pinned!r} does not exist; known: "
                               f"{', '.join(r.replica_id for r in self.table.all())}")
            if replica.model != model:
                raise InvalidArgument(f"replica {pinned!r} serves {replica.model!r}, not {model!r}")
            if not replica.healthy:
                raise Unavailable(f"replica {pinned!r} is not healthy")
            return replica
        candidates = self.table.serving(model)
        if not candidates:
            raise Unavailable(f"no healthy engine replica serves {model!r}; retry shortly")
        return self.policy.pick(candidates, time.monotonic())

    async def tokenize(self, request: router_pb2.RouterGenerateRequest, model: str) -> list[int]:
        kind = request.WhichOneof("input")
        try:
            if kind == "chat":
                enc = await self.tokenizer.ApplyChatTemplate(
                    tokenizer_pb2.ChatTemplateRequest(model=model, messages=request.chat.messages,
                                                      add_generation_prompt=True),
                    metadata=outgoing_metadata(), timeout=30.0)
            elif kind == "prompt":
                enc = await self.tokenizer.Encode(
                    tokenizer_pb2.EncodeRequest(model=model, text=request.prompt, add_special_tokens=True),
                    metadata=outgoing_metadata(), timeout=30.0)
            else:
                raise InvalidArgument("the request has neither chat messages nor a prompt")
        except grpc.aio.AioRpcError as err:
            raise _relay_error("tokenizer", err) from None
        return list(enc.ids)

    @rpc_errors
    async def Generate(self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        with server_span("router.generate", context, request_id=request_id) as span:
            model = self.resolve_model(request.model)
            prompt_ids = await self.tokenize(request, model)
            replica = self.pick(model, request.pinned_replica)
            span.set_attributes({"replica": replica.replica_id, "policy": self.config.policy,
                                 "prompt_tokens": len(prompt_ids)})
            served_by = common_pb2.ServedBy(replica=replica.replica_id, model=model,
                                            model_version=replica.model_version, region=replica.region,
                                            degraded=False, confidence=1.0)
            async for reply in self._relay(request, request_id, model, prompt_ids, replica, served_by):
                yield reply

    async def _relay(self, request: router_pb2.RouterGenerateRequest, request_id: str, model: str,
                     prompt_ids: list[int], replica: Replica, served_by: common_pb2.ServedBy
                     ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        call = self.engine_stub(replica).Generate(
            engine_pb2.GenerateRequest(request_id=request_id, model=model, prompt_ids=prompt_ids,
                                       sampling=request.sampling, priority=request.priority),
            metadata=outgoing_metadata())
        decoder = IncrementalDecoder(await self.decode_fn(model))
        stops = StopMatcher(list(request.sampling.stop))
        replica.in_flight += 1
        first = True
        try:
            async for chunk in call:
                final = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                text = decoder.push(list(chunk.ids), final)
                emit, stopped = stops.push(text)
                if final or stopped:
                    if not stopped:
                        emit += stops.flush()
                    reason = common_pb2.FINISH_REASON_STOP if stopped else chunk.finish_reason
                    usage = chunk.usage if final else common_pb2.Usage(
                        prompt_tokens=len(prompt_ids), completion_tokens=len(decoder.ids))
                    yield router_pb2.RouterGenerateResponse(
                        text=emit, ids=chunk.ids if request.include_token_ids else [],
                        logprobs=chunk.logprobs, finish_reason=reason, usage=usage, served_by=served_by)
                    return
                # The first message names the replica too, so callers can label the stream early.
                yield router_pb2.RouterGenerateResponse(
                    text=emit, ids=chunk.ids if request.include_token_ids else [], logprobs=chunk.logprobs,
                    served_by=served_by if first else None)
                first = False
        except grpc.aio.AioRpcError as err:
            raise _relay_error(f"engine {replica.replica_id}", err) from None
        finally:
            replica.in_flight -= 1
            call.cancel()

    @rpc_errors
    async def ListModels(self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> router_pb2.ListModelsResponse:
        reply = router_pb2.ListModelsResponse()
        for name in self.table.models():
            replicas = [r for r in self.table.all() if r.model == name]
            reply.models.add(name=name, version=replicas[0].model_version,
                             replicas=sum(r.healthy for r in replicas),
                             max_context=max(r.max_context for r in replicas))
        return reply

    @rpc_errors
    async def ListReplicas(self, request: router_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
                           ) -> router_pb2.ListReplicasResponse:
        reply = router_pb2.ListReplicasResponse()
        for r in self.table.all():
            reply.replicas.add(replica_id=r.replica_id, address=r.address, model=r.model,
                               model_version=r.model_version, region=r.region, healthy=r.healthy)
        return reply


def _relay_error(hop: str, err: grpc.aio.AioRpcError) -> Exception:
    """Keep a downstream status that the caller can act on; name the hop that failed."""
    from mesh.errors import MeshError

    exc = MeshError(f"{hop}: {err.details()}")
    exc.code = err.code() if err.code() != grpc.StatusCode.UNKNOWN else grpc.StatusCode.INTERNAL
    return exc
