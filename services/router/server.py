"""Router gRPC servicer: RPC handlers and protobuf conversion, nothing else.

The parts it is built from do the work:

    watch.py     ReplicaWatch: discovery, health/info probes and load reports -> the replica table
    dispatch.py  Dispatcher: one request's way (session, tokenize, pick, attempts, failover)
    upstream.py  the tokenizer and session-store clients, behind their breakers
    engines.py   the engine client (channels, Generate, GetInfo, WatchLoad, LoadReport <-> protobuf, lifecycle)
    admin.py     Admin: models, version routing and replicas, as plain values
    request.py   RouterRequest and Reply: a Generate's question and answers, as the dispatcher reads them
    wire.py      the Router messages <-> those plain values (Generate's request and replies, ModelRouting, ...)
    tokenize_rpcs.py  TokenRPCs: Tokenize and Detokenize (the edge's /tokenize, /detokenize)
    conversations.py  ConversationRPCs: ForgetConversation (a stored conversation deleted), StoreTurn
    lora_rpcs.py LoraRPCs: LoRA adapters loaded, unloaded, listed (the work: lora.py)

The policies (policies/), failover (failover/) and stop strings (stops.py) are pure code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from mesh.errors import InvalidArgument, MeshError
from mesh.grpcutil import rpc_errors
from mesh.request_limits import name_problem
from mesh.telemetry import server_span
from meshpb.v1 import router_pb2, router_pb2_grpc
from services.router import metrics
from services.router.admin import Admin
from services.router.callers import Callers, refusal, tokens_used
from services.router.config import RouterConfig
from services.router.conversations import ConversationRPCs
from services.router.dispatch import Dispatcher
from services.router.engines import Engines, load_to_pb
from services.router.events import RECENT
from services.router.failover import Failover, Saturated
from services.router.lora_rpcs import LoraRPCs
from services.router.policies import PolicyConfig, make_policy
from services.router.replicas import ReplicaTable
from services.router.swap import add, drain, load_everywhere
from services.router.tokenize_rpcs import TokenRPCs
from services.router.upstream import Sessions, Tokenizer
from services.router.versions import ModelVersions
from services.router.watch import ReplicaWatch
from services.router.wire import fill_recent, reply_pb, request_from_pb, routing_pb


class RouterServicer(TokenRPCs, ConversationRPCs, LoraRPCs, router_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig):
        self.config = config
        self.table = ReplicaTable()
        self.policy = make_policy(config.policy, PolicyConfig(region=config.region))
        self.failover = Failover(config.failover())
        versions = ModelVersions(dict(config.default_versions))
        engines = Engines()
        self.tokenizer = Tokenizer(config.tokenizer, name=f"tokenizer@{config.port}")
        self.sessions = Sessions(config.cache, name=f"sessions@{config.port}")
        self.watch = ReplicaWatch(config, self.table, self.failover, engines, self.tokenizer.probed)
        self.dispatcher = Dispatcher(config, self.table, self.policy, self.failover, versions, engines,
                                     self.tokenizer, self.sessions)
        self.lora = self.dispatcher.lora
        self.admin = Admin(self.table, versions, self.failover, self.policy, config.default_model,
                           self.dispatcher.shadows, self.lora)
        self.callers = Callers(config.api_key_digests, config.admin_key_digests, config.rate_limit,
                               config.auth_failure_limit, config.token_limit)
        metrics.watch_policy(self.policy.load_entropy, lambda: sum(r.healthy for r in self.table.all()),
                             self.admin.snapshot)

    async def start(self, report_ready: Callable[[bool], Awaitable[None]] | None = None) -> None:
        """Probe the tokenizer and engines, then keep following them (and report readiness)."""
        await self.watch.start(report_ready)

    async def close(self) -> None:
        await self.dispatcher.shadows.close()
        await self.watch.close()

    def ready(self) -> bool:
        """SERVING only while the tokenizer and at least one engine are healthy."""
        return self.watch.ready()

    def add_to(self, server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(self, server)

    @rpc_errors
    async def Generate(self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        with server_span("router.generate", context, request_id=request_id):
            try:
                # The edge names the tenant (from an API key); a native caller is its own key's tenant.
                caller = self.callers.caller(context, request.tenant)
                ask = dataclasses.replace(request_from_pb(request), tenant=caller.tenant)
                refused = refusal(ask)
                if refused:                   # a native caller skipped the edge's checks: the same limits here
                    raise InvalidArgument(refused)
                ask = dataclasses.replace(ask, weight=self.callers.weight(context, caller, ask.weight))
                # A native key's tokens: reserved once the prompt is tokenized, settled to the usage.
                charge = self.callers.charge(caller, ask.sampling.max_tokens)
                replies = self.callers.metered(charge, self.dispatcher.generate(
                    ask, request_id, context, self.callers.admission(charge)), tokens_used)
                async with contextlib.aclosing(replies):        # settled now, not when collected
                    async for reply in replies:
                        yield reply_pb(reply)
            except MeshError as exc:
                if isinstance(exc, Saturated):
                    metrics.SHED.labels(exc.model).inc()
                    RECENT.record("shed", exc.model, "", exc.detail)
                raise                                 # rpc_errors sends its retry-after

    @rpc_errors
    async def ListModels(self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> router_pb2.ListModelsResponse:
        self.callers.check_user(context, "ListModels")
        reply = router_pb2.ListModelsResponse()
        for m in self.admin.models():
            reply.models.add(name=m.name, version=m.version, replicas=m.replicas, max_context=m.max_context,
                             versions=m.versions)
        reply.adapters.extend(self.lora_listing().adapters)
        return reply

    @rpc_errors
    async def GetModelRouting(self, request: router_pb2.ModelRoutingRequest, context: grpc.aio.ServicerContext
                              ) -> router_pb2.ModelRouting:
        self.callers.check_user(context, "GetModelRouting")
        return routing_pb(self.admin.routing(self.admin.resolve(request.model)))

    @rpc_errors
    async def SetModelRouting(self, request: router_pb2.SetModelRoutingRequest, context: grpc.aio.ServicerContext
                              ) -> router_pb2.ModelRouting:
        """Switch the default version / canary shares.  Requests already streaming keep their replica."""
        self.callers.check_admin(context, "SetModelRouting")
        model = self.admin.resolve(request.model)
        canary = dict(request.canary) if request.replace_canary else None
        shadow = (request.shadow_version, request.shadow_share) if request.replace_shadow else None
        return routing_pb(self.admin.set_routing(model, request.default_version, canary, shadow))

    @rpc_errors
    async def LoadModelVersion(self, request: router_pb2.LoadModelVersionRequest,
                               context: grpc.aio.ServicerContext) -> router_pb2.LoadModelVersionResponse:
        """Hot swap on every replica of the model (services/router/swap.py); with activate, the default."""
        self.callers.check_admin(context, "LoadModelVersion")
        model = self.admin.resolve(request.model)
        refused = name_problem("version", request.version)
        if refused or not request.version:
            raise InvalidArgument(refused or "version is empty")
        loaded = await load_everywhere(self.table, self.watch.engines, model, request.version, request.source,
                                       request.activate)
        routing = self.admin.set_routing(model, request.version, None) if request.activate else \
            self.admin.routing(model)
        reply = router_pb2.LoadModelVersionResponse(routing=routing_pb(routing))
        for r in loaded:
            reply.replicas.add(replica_id=r.replica_id, active_version=r.active_version,
                               loaded_versions=r.loaded_versions, load_seconds=r.load_seconds)
        return reply

    @rpc_errors
    async def DrainReplica(self, request: router_pb2.DrainReplicaRequest, context: grpc.aio.ServicerContext
                           ) -> router_pb2.DrainReplicaResponse:
        self.callers.check_admin(context, "DrainReplica")
        finished = await drain(self.table, self.watch.engines, self.watch.discovery, request.replica_id)
        return router_pb2.DrainReplicaResponse(replica_id=request.replica_id, finished=finished)

    @rpc_errors
    async def AddReplica(self, request: router_pb2.AddReplicaRequest, context: grpc.aio.ServicerContext
                         ) -> router_pb2.AddReplicaResponse:
        self.callers.check_admin(context, "AddReplica")
        await add(self.watch.discovery, request.replica_id, request.address, request.region)
        return router_pb2.AddReplicaResponse()

    @rpc_errors
    async def ListReplicas(self, request: router_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
                           ) -> router_pb2.ListReplicasResponse:
        self.callers.check_user(context, "ListReplicas")
        now = time.monotonic()
        reply = router_pb2.ListReplicasResponse(load_entropy=self.admin.load_entropy(now), ready=self.ready(),
                                                tokenizer_healthy=self.watch.tokenizer_healthy,
                                                expected_engines=self.config.expected_engines)
        for state in self.admin.replicas(now):
            r = state.replica
            reply.replicas.add(replica_id=r.replica_id, address=r.address, model=r.model,
                               model_version=r.model_version, region=r.region, healthy=r.healthy,
                               load=load_to_pb(r.replica_id, r.load), breaker=state.breaker, in_flight=r.in_flight,
                               weight=r.weight, isolation=state.isolation)
        fill_recent(reply, RECENT)
        return reply
