"""Router gRPC servicer: tokenize, pick a replica, relay the engine's stream as text deltas.

No policy lives here: the choice is the policy's (services/router/policies), the stop-string
logic is StopMatcher's; this file converts protobuf and moves bytes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from mesh.chat import Message
from mesh.discovery import make_discovery
from mesh.errors import InvalidArgument, NotFound, Unavailable
from mesh.grpcutil import channel, check_health, rpc_errors
from mesh.prefix import block_hashes
from mesh.telemetry import outgoing_metadata, server_span
from meshpb.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.router import metrics
from services.router.config import RouterConfig
from services.router.policies import Decision, PolicyConfig, RouteRequest, make_policy
from services.router.relay import EngineFailed, Stream, attempt
from services.router.replicas import LoadReport, Replica, ReplicaTable
from services.router.sessions import merge
from services.router.versions import ModelVersions, version_key

log = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig):
        self.config = config
        self.table = ReplicaTable()
        self.policy = make_policy(config.policy, PolicyConfig(region=config.region))
        self.discovery = make_discovery(config.discovery, config.engines)
        self.block_size = 16                    # the engines' KV block size, from GetInfo: prefix hashes use it
        self._load_watchers: dict[str, asyncio.Task[None]] = {}
        self._probe_misses: dict[str, int] = {}
        metrics.watch_policy(self.policy.load_entropy, lambda: sum(r.healthy for r in self.table.all()))
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(channel(config.tokenizer))
        self.cache = cache_pb2_grpc.CacheStub(channel(config.cache)) if config.cache else None
        self.versions = ModelVersions(dict(config.default_versions))
        self._engine_stubs: dict[str, engine_pb2_grpc.EngineStub] = {}
        self.tokenizer_healthy = False
        self._decoders: dict[str, Callable[[Sequence[int]], str]] = {}

    # -- replica state -----------------------------------------------------------------
    def engine_stub(self, replica: Replica) -> engine_pb2_grpc.EngineStub:
        stub = self._engine_stubs.get(replica.address)
        if stub is None:
            stub = self._engine_stubs[replica.address] = engine_pb2_grpc.EngineStub(channel(replica.address))
        return stub

    # Replicas come from discovery (static: the launcher's list; Consul: whatever passes its
    # checks); each gets a health/info probe every interval and a stream of load reports.
    async def follow_discovery(self) -> None:
        async for endpoints in self.discovery.watch("engine"):
            added, removed = self.table.sync(endpoints)
            for replica in removed:
                log.info("replica %s (%s) left", replica.replica_id, replica.address)
                watcher = self._load_watchers.pop(replica.replica_id, None)
                if watcher is not None:
                    watcher.cancel()
            for replica in added:
                log.info("replica %s (%s) joined", replica.replica_id, replica.address)
                await self.probe(replica)
                self._load_watchers[replica.replica_id] = asyncio.create_task(self.follow_load(replica))

    async def follow_load(self, replica: Replica) -> None:
        """Apply the engine's load reports (WatchLoad) as they come; reconnect after failures."""
        while True:
            call = self.engine_stub(replica).WatchLoad(engine_pb2.LoadRequest(interval_ms=self.config.load_interval_ms))
            try:
                async for r in call:
                    replica.apply_load(LoadReport(
                        running=r.running, waiting=r.waiting, kv_blocks_total=r.kv_blocks_total,
                        kv_blocks_free=r.kv_blocks_free, qps=r.qps, p50_latency_ms=r.p50_latency_ms,
                        p99_latency_ms=r.p99_latency_ms, tokens_per_second=r.tokens_per_second,
                        unix_ms=r.unix_ms), time.monotonic())
            except grpc.aio.AioRpcError:
                pass                            # the health probe marks the replica; retry below
            finally:
                call.cancel()
            await asyncio.sleep(self.config.probe_interval_s)

    async def close(self) -> None:
        for watcher in self._load_watchers.values():
            watcher.cancel()
        await self.discovery.close()

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
                self.block_size = info.block_size or self.block_size
        # One missed probe on a CPU-saturated machine is not a dead replica: isolate after
        # `unhealthy_after` misses in a row (~2 s), re-admit on the first success.
        misses = 0 if healthy else self._probe_misses.get(replica.replica_id, 0) + 1
        self._probe_misses[replica.replica_id] = misses
        if not healthy and replica.healthy and misses < self.config.unhealthy_after:
            return
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
    def resolve_model(self, model: str, version: str = "") -> tuple[str, str]:
        """`name`, `name@version` or "" (the default model) -> (name, pinned version or "")."""
        name, _, at_version = model.partition("@")
        if at_version and version and at_version != version:
            raise InvalidArgument(f"model {model!r} names version {at_version!r} but the request pins {version!r}")
        name = name if name and name != "default" else self.config.default_model
        if name not in self.table.models():
            known = ", ".join(self.table.models()) or "none yet"
            raise NotFound(f"model {name!r} is not served; available: {known}")
        return name, at_version or version

    def served_versions(self, model: str) -> set[str]:
        return {r.model_version for r in self.table.serving(model)}

    def pick(self, model: str, pinned: str, route: RouteRequest, version: str = "",
             exclude: set[str] | None = None) -> Decision:
        if pinned:
            replica = self.table.get(pinned)
            if replica is None:
                raise NotFound(f"replica {pinned!r} does not exist; known: "
                               f"{', '.join(r.replica_id for r in self.table.all())}")
            if replica.model != model:
                raise InvalidArgument(f"replica {pinned!r} serves {replica.model!r}, not {model!r}")
            if not replica.healthy:
                raise Unavailable(f"replica {pinned!r} is not healthy")
            return Decision(replica, "pinned")
        candidates = [r for r in self.table.serving(model) if (not version or r.model_version == version)
                      and r.replica_id not in (exclude or ())]
        if not candidates:
            left = f" besides {', '.join(sorted(exclude))}" if exclude else ""
            raise Unavailable(f"no healthy engine replica serves {model!r}{left}; retry shortly")
        return self.policy.pick(candidates, route, time.monotonic())

    # -- sessions ----------------------------------------------------------------------
    async def session_history(self, session_id: str) -> list[Message]:
        """The stored conversation, or [] (no session store, no such session, or the store is
        down: the request then goes on with the messages it carries, and a warning is logged)."""
        if self.cache is None or not session_id:
            return []
        try:
            found = await self.cache.GetSession(cache_pb2.SessionRequest(session_id=session_id),
                                                metadata=outgoing_metadata(), timeout=5.0)
        except grpc.aio.AioRpcError as err:
            log.warning("session store unavailable (%s); session %s goes on without its history",
                        err.code().name, session_id)
            return []
        return [Message(m.role, m.content, m.name) for m in found.messages]

    async def remember(self, session_id: str, messages: list[Message]) -> None:
        if self.cache is None or not session_id or not messages:
            return
        try:
            await self.cache.AppendSession(
                cache_pb2.AppendSessionRequest(session_id=session_id, messages=[
                    tokenizer_pb2.ChatMessage(role=m.role, content=m.content, name=m.name) for m in messages]),
                metadata=outgoing_metadata(), timeout=5.0)
        except grpc.aio.AioRpcError as err:
            log.warning("session %s: could not store the turn (%s)", session_id, err.code().name)

    async def tokenize(self, request: router_pb2.RouterGenerateRequest, model: str,
                       conversation: list[Message]) -> list[int]:
        kind = request.WhichOneof("input")
        try:
            if kind == "chat":
                messages = [tokenizer_pb2.ChatMessage(role=m.role, content=m.content, name=m.name)
                            for m in conversation]
                enc = await self.tokenizer.ApplyChatTemplate(
                    tokenizer_pb2.ChatTemplateRequest(model=model, messages=messages, add_generation_prompt=True),
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
            model, pinned_version = self.resolve_model(request.model, request.model_version)
            session = request.session_id if request.WhichOneof("input") == "chat" else ""
            incoming = [Message(m.role, m.content, m.name) for m in request.chat.messages]
            conversation, new = merge(await self.session_history(session), incoming)
            prompt_ids = await self.tokenize(request, model, conversation)
            version = "" if request.pinned_replica else self.versions.choose(
                model, self.served_versions(model), pinned_version, request.session_id or request_id)
            route = RouteRequest(model, session_key=request.session_id, region=request.region,
                                 prefix_hashes=tuple(block_hashes(prompt_ids, self.block_size)))
            span.set_attributes({"policy": self.config.policy, "prompt_tokens": len(prompt_ids),
                                 "session_messages": len(conversation) - len(new)})
            stream = Stream(await self.decode_fn(model), request.sampling.stop, len(prompt_ids),
                            request.include_token_ids)
            answer: list[str] = []
            async for reply in self._generate(request, request_id, model, version, prompt_ids, route, stream,
                                              context):
                answer.append(reply.text)
                if reply.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    await self.remember(session, [*new, Message("assistant", "".join(answer))])
                yield reply

    async def _generate(self, request: router_pb2.RouterGenerateRequest, request_id: str, model: str, version: str,
                        prompt_ids: list[int], route: RouteRequest, stream: Stream,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        """Attempts until the stream finishes: a replica that fails mid-stream is left behind and
        another continues from the tokens already sent (a pinned request is not moved)."""
        failed: list[str] = []
        while True:
            decision = self.pick(model, request.pinned_replica, route, version, exclude=set(failed))
            replica = decision.replica
            version = version or replica.model_version          # a resumed stream stays on its version
            metrics.ROUTED.labels(model, replica.model_version, replica.replica_id,
                                  "failover" if failed else decision.reason).inc()
            served_by = common_pb2.ServedBy(replica=replica.replica_id, model=model,
                                            model_version=replica.model_version, region=replica.region,
                                            degraded=False, confidence=1.0)
            engine_request = engine_pb2.GenerateRequest(
                request_id=request_id, model=model, prompt_ids=prompt_ids, sampling=request.sampling,
                priority=request.priority, resume_ids=stream.ids)
            replica.in_flight += 1
            metrics.IN_FLIGHT.labels(replica.replica_id).inc()
            started, ok = time.monotonic(), True
            self.policy.on_start(replica, route, started)
            try:
                async for reply in attempt(self.engine_stub(replica), replica.replica_id, engine_request, stream,
                                           served_by, outgoing_metadata(), context.time_remaining(),
                                           self.config.first_token_timeout_s, self.config.stall_timeout_s,
                                           _relay_error, functools.partial(getattr, replica, "healthy")):
                    yield reply
                return
            except EngineFailed as exc:
                ok = False
                failed.append(replica.replica_id)
                metrics.FAILED.labels(replica.replica_id).inc()
                limit = request.sampling.max_tokens
                if limit and len(stream.ids) >= limit:
                    yield stream.finish_at_length(served_by)
                    return
                if request.pinned_replica or len(failed) >= self.config.max_attempts:
                    raise Unavailable(f"{exc}; {len(failed)} attempt(s) made"
                                      + ("" if not request.pinned_replica else " (the request is pinned to it)")
                                      ) from None
                log.warning("request %s: %s after %d token(s); continuing on another replica",
                            request_id, exc, len(stream.ids))
            finally:
                replica.in_flight -= 1
                metrics.IN_FLIGHT.labels(replica.replica_id).dec()
                now = time.monotonic()
                self.policy.on_finish(replica, route, now, now - started, ok)

    @rpc_errors
    async def ListModels(self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> router_pb2.ListModelsResponse:
        reply = router_pb2.ListModelsResponse()
        for name in self.table.models():
            replicas = [r for r in self.table.all() if r.model == name]
            versions = sorted({r.model_version for r in replicas}, key=version_key)
            default = self.versions.routing(name, self.served_versions(name) or versions).default
            reply.models.add(name=name, version=default, replicas=sum(r.healthy for r in replicas),
                             max_context=max(r.max_context for r in replicas), versions=versions)
        return reply

    def model_routing(self, model: str) -> router_pb2.ModelRouting:
        served = {r.model_version for r in self.table.all() if r.model == model}
        routing = self.versions.routing(model, served)
        return router_pb2.ModelRouting(model=model, default_version=routing.default, canary=routing.canary,
                                       versions=sorted(served, key=version_key))

    @rpc_errors
    async def GetModelRouting(self, request: router_pb2.ModelRoutingRequest, context: grpc.aio.ServicerContext
                              ) -> router_pb2.ModelRouting:
        model, _ = self.resolve_model(request.model)
        return self.model_routing(model)

    @rpc_errors
    async def SetModelRouting(self, request: router_pb2.SetModelRoutingRequest, context: grpc.aio.ServicerContext
                              ) -> router_pb2.ModelRouting:
        """Switch the default version / canary shares.  Requests already streaming keep their replica."""
        model, _ = self.resolve_model(request.model)
        served = {r.model_version for r in self.table.all() if r.model == model}
        self.versions.set(model, served, request.default_version,
                          dict(request.canary) if request.replace_canary else None)
        routing = self.model_routing(model)
        log.info("model %s: default version %s, canary %s", model, routing.default_version, dict(routing.canary))
        return routing

    @rpc_errors
    async def ListReplicas(self, request: router_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
                           ) -> router_pb2.ListReplicasResponse:
        reply = router_pb2.ListReplicasResponse()
        for r in self.table.all():
            load = common_pb2.LoadReport(
                replica_id=r.replica_id, running=r.running, waiting=r.waiting, kv_blocks_total=r.kv_blocks_total,
                kv_blocks_free=r.kv_blocks_free, qps=r.qps, p50_latency_ms=r.p50_latency_ms,
                p99_latency_ms=r.p99_latency_ms, tokens_per_second=r.tokens_per_second, unix_ms=r.unix_ms)
            reply.replicas.add(replica_id=r.replica_id, address=r.address, model=r.model,
                               model_version=r.model_version, region=r.region, healthy=r.healthy, load=load)
        return reply


def _relay_error(hop: str, err: grpc.aio.AioRpcError) -> Exception:
    """Keep a downstream status that the caller can act on; name the hop that failed."""
    from mesh.errors import MeshError

    exc = MeshError(f"{hop}: {err.details()}")
    exc.code = err.code() if err.code() != grpc.StatusCode.UNKNOWN else grpc.StatusCode.INTERNAL
    return exc
