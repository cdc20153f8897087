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
from typing import Any

import grpc
from circuitbreaker import CircuitBreaker, CircuitBreakerError
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from mesh.chat import Message
from mesh.discovery import make_discovery
from mesh.errors import InvalidArgument, MeshError, NotFound, Unavailable
from mesh.grpcutil import channel, check_health, rpc_errors
from mesh.prefix import block_hashes
from mesh.telemetry import client_span, outgoing_metadata, server_span, span_context, tracer
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
from services.router.failover import BreakerConfig, Call, Failover, FailoverConfig, Plan, Saturated
from services.router.policies import PolicyConfig, RouteRequest, make_policy
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
        self.failover = Failover(FailoverConfig(
            fallbacks={m: (n, c) for m, n, c in config.fallbacks}, max_attempts=config.max_attempts,
            replica=BreakerConfig(p99_target_s=config.p99_target_ms / 1000 if config.p99_target_ms else None)))
        self.block_size = 16                    # the engines' KV block size, from GetInfo: prefix hashes use it
        self._load_watchers: dict[str, asyncio.Task[None]] = {}
        self._probe_misses: dict[str, int] = {}
        metrics.watch_policy(self.policy.load_entropy, lambda: sum(r.healthy for r in self.table.all()),
                             self.metrics_snapshot)
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(channel(config.tokenizer))
        self.cache = cache_pb2_grpc.CacheStub(channel(config.cache)) if config.cache else None
        # The single-replica dependencies get the `circuitbreaker` package's breaker (consecutive
        # failures, fixed recovery time: all they need): when one is down, requests fail fast
        # (tokenizer) or go on without history (session store) instead of each waiting out a timeout.
        # Engines need more (windows, probes, a fake clock in tests): services/router/failover.
        self.tokenizer_breaker = CircuitBreaker(failure_threshold=3, recovery_timeout=5,
                                                expected_exception=_dependency_down, name=f"tokenizer@{config.port}")
        self.session_breaker = CircuitBreaker(failure_threshold=3, recovery_timeout=10,
                                              expected_exception=_dependency_down, name=f"sessions@{config.port}")
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
                self.failover.forget(replica.replica_id)
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

    def metrics_snapshot(self, now: float) -> metrics.Snapshot:
        """The replica table and breakers, for the gauges Prometheus reads when it scrapes."""
        replicas = [metrics.ReplicaSample(r.replica_id, r.model, r.model_version, r.region,
                                          r.healthy and self.failover.isolation(r.replica_id) is None,
                                          r.running, r.waiting, r.mem_ratio) for r in self.table.all()]
        return metrics.Snapshot(replicas, {rid: str(state) for rid, state in self.failover.states(now).items()},
                                {m: str(state) for m, state in self.failover.model_states(now).items()})

    async def close(self) -> None:
        for watcher in self._load_watchers.values():
            watcher.cancel()
        await self.discovery.close()

    async def probe(self, replica: Replica) -> None:
        checked_at = time.monotonic()
        healthy = await check_health(replica.address)
        self.failover.health_checked(replica.replica_id, healthy, checked_at)
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
                with client_span("router.tokenizer_json", model=model):
                    spec = await self.tokenizer.GetTokenizerJson(tokenizer_pb2.ModelInfoRequest(model=model),
                                                                 metadata=outgoing_metadata(), timeout=30.0)
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

    def pinned(self, model: str, pinned: str) -> Replica:
        replica = self.table.get(pinned)
        if replica is None:
            raise NotFound(f"replica {pinned!r} does not exist; known: "
                           f"{', '.join(r.replica_id for r in self.table.all())}")
        if replica.model != model:
            raise InvalidArgument(f"replica {pinned!r} serves {replica.model!r}, not {model!r}")
        why = self.failover.refusal(replica, time.monotonic())
        if why:
            raise Unavailable(f"replica {pinned!r} is {why}; retry shortly or drop the pin")
        return replica

    # -- sessions ----------------------------------------------------------------------
    async def session_history(self, session_id: str) -> list[Message]:
        """The stored conversation, or [] (no session store, no such session, or the store is
        down: the request then goes on with the messages it carries, and a warning is logged)."""
        if self.cache is None or not session_id:
            return []
        try:
            with client_span("router.session_lookup", session_id=session_id) as span:
                found = await self.session_breaker.call_async(
                    self.cache.GetSession, cache_pb2.SessionRequest(session_id=session_id),
                    metadata=outgoing_metadata(), timeout=5.0)
                span.set_attributes({"found": found.found, "messages": len(found.messages)})
        except (grpc.aio.AioRpcError, CircuitBreakerError) as err:
            why = err.code().name if isinstance(err, grpc.aio.AioRpcError) else "circuit open"
            log.warning("session store unavailable (%s); session %s goes on without its history", why, session_id)
            return []
        return [Message(m.role, m.content, m.name) for m in found.messages]

    async def remember(self, session_id: str, messages: list[Message]) -> None:
        if self.cache is None or not session_id or not messages:
            return
        try:
            with client_span("router.session_store", session_id=session_id, messages=len(messages)):
                await self.session_breaker.call_async(
                    self.cache.AppendSession,
                    cache_pb2.AppendSessionRequest(session_id=session_id, messages=[
                        tokenizer_pb2.ChatMessage(role=m.role, content=m.content, name=m.name) for m in messages]),
                    metadata=outgoing_metadata(), timeout=5.0)
        except (grpc.aio.AioRpcError, CircuitBreakerError) as err:
            why = err.code().name if isinstance(err, grpc.aio.AioRpcError) else "circuit open"
            log.warning("session %s: could not store the turn (%s)", session_id, why)

    async def tokenize(self, request: router_pb2.RouterGenerateRequest, model: str,
                       conversation: list[Message], deadline_s: float | None = None) -> list[int]:
        kind = request.WhichOneof("input")
        if kind not in ("chat", "prompt"):
            raise InvalidArgument("the request has neither chat messages nor a prompt")
        try:
            with client_span("router.tokenize", model=model, input=kind) as span:
                if kind == "chat":
                    messages = [tokenizer_pb2.ChatMessage(role=m.role, content=m.content, name=m.name)
                                for m in conversation]
                    enc = await self.tokenizer_breaker.call_async(
                        self.tokenizer.ApplyChatTemplate,
                        tokenizer_pb2.ChatTemplateRequest(model=model, messages=messages, add_generation_prompt=True),
                        metadata=outgoing_metadata(), timeout=_within(deadline_s, 30.0))
                else:
                    enc = await self.tokenizer_breaker.call_async(
                        self.tokenizer.Encode,
                        tokenizer_pb2.EncodeRequest(model=model, text=request.prompt, add_special_tokens=True),
                        metadata=outgoing_metadata(), timeout=_within(deadline_s, 30.0))
                span.set_attribute("prompt_tokens", len(enc.ids))
        except CircuitBreakerError:
            wait = max(1, self.tokenizer_breaker.open_remaining)
            raise Unavailable(f"tokenizer {self.config.tokenizer} is failing: not called again for {wait} s "
                              "(circuit open)", retry_after_s=wait) from None
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
            version = self.choose_version(model, pinned_version, request)
            span.set_attributes({"policy": self.config.policy, "session_messages": len(conversation) - len(new)})
            answer: list[str] = []
            try:
                async for reply in self._generate(request, request_id, model, version, conversation, context):
                    answer.append(reply.text)
                    if reply.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        await self.remember(session, [*new, Message("assistant", "".join(answer))])
                    yield reply
            except MeshError as exc:
                if isinstance(exc, Saturated):
                    metrics.SHED.labels(exc.model).inc()
                if exc.retry_after_s > 0:             # Saturated, a tripped dependency breaker
                    context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
                raise

    def choose_version(self, model: str, pinned_version: str, request: router_pb2.RouterGenerateRequest) -> str:
        """The version this request runs on; "" when any will do (a pinned replica, or none serving:
        then failover decides, possibly for a fallback model)."""
        if pinned_version:
            if pinned_version not in {r.model_version for r in self.table.all() if r.model == model}:
                raise NotFound(f"version {pinned_version!r} of {model!r} is not served")
            return pinned_version
        served = self.served_versions(model)
        if request.pinned_replica or not served:
            return ""
        return self.versions.choose(model, served, "", request.session_id or request.request_id)

    async def _prepare(self, request: router_pb2.RouterGenerateRequest, model: str, conversation: list[Message],
                       deadline_s: float | None = None
                       ) -> tuple[list[int], Stream, RouteRequest]:
        """Token ids, a fresh client stream and the routing request, for `model`'s tokenizer."""
        prompt_ids = await self.tokenize(request, model, conversation, deadline_s)
        stream = Stream(await self.decode_fn(model), request.sampling.stop, len(prompt_ids), request.include_token_ids)
        route = RouteRequest(model, session_key=request.session_id, region=request.region,
                             prefix_hashes=tuple(block_hashes(prompt_ids, self.block_size)))
        return prompt_ids, stream, route

    async def _generate(self, request: router_pb2.RouterGenerateRequest, request_id: str, model: str, version: str,
                        conversation: list[Message], context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        """Attempts until the stream finishes (services/router/failover decides where and whether):
        a replica that fails is left behind; mid-stream, another replica of the same model continues
        from the tokens already sent; before the first token, a fallback model may take over."""
        root = trace.get_current_span()                # router.generate: it carries the final decision
        prompt_ids, stream, route = await self._prepare(request, model, conversation, context.time_remaining())
        if request.pinned_replica:                     # operators and tests: exactly there, or an error
            replica = self.pinned(model, request.pinned_replica)
            pinned = Plan(model, [replica], False, 1.0)
            root.set_attributes(_decision(replica, pinned, "pinned", 0))
            try:
                async for reply in self._attempt(replica, pinned, "pinned", request, request_id, prompt_ids, stream,
                                                 route, context):
                    yield reply
            except EngineFailed as exc:
                raise Unavailable(f"{exc} (the request is pinned to it)") from None
            return
        now = time.monotonic
        call = Call(self.failover, model, now())
        streamed = model                               # the model whose tokens `stream` holds
        try:
            for _ in range(4 * self.failover.config.max_attempts):
                pool = [r for r in self.table.all() if r.model != model or not version or r.model_version == version]
                if stream.ids:                         # a stream continues on the model it started with
                    pool = [r for r in pool if r.model == streamed]
                plan = call.plan(pool, now())
                if plan.model != streamed:             # nothing sent yet: the fallback model's own prompt
                    if plan.degraded:
                        metrics.FAILOVER.labels("3").inc()
                    prompt_ids, stream, route = await self._prepare(request, plan.model, conversation,
                                                                    context.time_remaining())
                    streamed = plan.model
                decision = self.policy.pick(plan.candidates, route, now())
                attempt = call.start(decision.replica, now())
                if attempt is None:
                    continue
                reason = "fallback" if plan.degraded else "failover" if call.attempts > 1 else decision.reason
                root.set_attributes(_decision(decision.replica, plan, reason, call.attempts - 1))
                started, first_token_s = now(), None
                try:
                    async for reply in self._attempt(decision.replica, plan, reason, request, request_id, prompt_ids,
                                                     stream, route, context):
                        first_token_s = now() - started if first_token_s is None else first_token_s
                        yield reply
                except EngineFailed as exc:
                    if exc.isolate:
                        self.failover.isolate(exc.replica_id, now(), exc.reason)
                        metrics.FAILOVER.labels("1").inc()
                    limit = request.sampling.max_tokens
                    if limit and len(stream.ids) >= limit:     # died after the last token, before its final message
                        call.succeeded(attempt, now(), first_token_s)
                        _count_degraded(model, plan)
                        yield stream.finish_at_length(self.served_by(decision.replica, plan))
                        return
                    if not call.failed(attempt, now(), first_token_s):
                        raise Unavailable(f"{exc}; no attempt or retry budget left for this request") from None
                    metrics.FAILOVER.labels("2").inc()
                    log.warning("request %s: %s after %d token(s); trying another replica",
                                request_id, exc, len(stream.ids))
                    continue
                except BaseException:                   # the client left, or a request error: no replica's fault
                    call.cancelled(attempt, now())
                    raise
                call.succeeded(attempt, now(), first_token_s)
                _count_degraded(model, plan)
                return
            raise Unavailable(f"no replica could be started for {model!r}; retry shortly")
        finally:
            call.close(now())

    def served_by(self, replica: Replica, plan: Plan) -> common_pb2.ServedBy:
        return common_pb2.ServedBy(replica=replica.replica_id, model=plan.model, model_version=replica.model_version,
                                   region=replica.region, degraded=plan.degraded, confidence=plan.confidence)

    async def _attempt(self, replica: Replica, plan: Plan, reason: str, request: router_pb2.RouterGenerateRequest,
                       request_id: str, prompt_ids: list[int], stream: Stream, route: RouteRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        """One engine call for the stream (resuming from its tokens), with the replica's bookkeeping."""
        metrics.ROUTED.labels(plan.model, replica.model_version, replica.replica_id, reason).inc()
        # Not made current: this generator is suspended at every yield, and its caller's code
        # runs meanwhile; the engine learns its parent from the metadata instead.
        span = tracer().start_span("router.attempt", kind=trace.SpanKind.CLIENT, attributes={
            **_decision(replica, plan, reason, None), "resumed_tokens": len(stream.ids)})
        engine_request = engine_pb2.GenerateRequest(
            request_id=request_id, model=plan.model, prompt_ids=prompt_ids, sampling=request.sampling,
            priority=request.priority, resume_ids=stream.ids)
        replica.in_flight += 1
        metrics.IN_FLIGHT.labels(replica.replica_id).inc()
        started, ok = time.monotonic(), True
        self.policy.on_start(replica, route, started)

        def admitted() -> bool:
            return replica.healthy and self.failover.isolation(replica.replica_id) is None

        try:
            async for reply in attempt(self.engine_stub(replica), replica.replica_id, engine_request, stream,
                                       self.served_by(replica, plan), outgoing_metadata(context=span_context(span)),
                                       context.time_remaining(),
                                       self.config.first_token_timeout_s, self.config.stall_timeout_s, _relay_error,
                                       admitted):
                yield reply
        except EngineFailed as exc:
            ok = False
            metrics.FAILED.labels(replica.replica_id).inc()
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            raise
        except Exception as exc:                        # a request error relayed from the engine
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            raise
        finally:
            span.end()
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
        now = time.monotonic()
        reply = router_pb2.ListReplicasResponse(load_entropy=self.policy.load_entropy(now))
        breakers = self.failover.states(now)
        for r in self.table.all():
            load = common_pb2.LoadReport(
                replica_id=r.replica_id, running=r.running, waiting=r.waiting, kv_blocks_total=r.kv_blocks_total,
                kv_blocks_free=r.kv_blocks_free, qps=r.qps, p50_latency_ms=r.p50_latency_ms,
                p99_latency_ms=r.p99_latency_ms, tokens_per_second=r.tokens_per_second, unix_ms=r.unix_ms)
            breaker = breakers.get(r.replica_id)
            reply.replicas.add(replica_id=r.replica_id, address=r.address, model=r.model,
                               model_version=r.model_version, region=r.region, healthy=r.healthy, load=load,
                               breaker=str(breaker) if breaker is not None else "closed", in_flight=r.in_flight,
                               isolation=self.failover.isolation(r.replica_id) or "")
        return reply


def _decision(replica: Replica, plan: Plan, reason: str, failover_attempts: int | None) -> dict[str, Any]:
    """The routing decision as span attributes (router.generate and router.attempt)."""
    attrs: dict[str, Any] = {"replica": replica.replica_id, "model_version": replica.model_version,
                             "served_model": plan.model, "region": replica.region, "reason": reason,
                             "degraded": plan.degraded, "confidence": plan.confidence}
    if failover_attempts is not None:
        attrs["failover_attempts"] = failover_attempts
    return attrs


def _count_degraded(model: str, plan: Plan) -> None:
    if plan.degraded:
        metrics.DEGRADED.labels(model, plan.model).inc()


def _within(deadline_s: float | None, cap: float) -> float:
    """A hop's timeout: its own cap, or less when the client's deadline comes sooner."""
    return cap if deadline_s is None else max(0.001, min(cap, deadline_s))


def _dependency_down(kind: type[BaseException], err: BaseException) -> bool:
    """What the dependency breakers count: the service failing, not a request it refused."""
    return isinstance(err, grpc.aio.AioRpcError) and err.code() in _DOWN_CODES


_DOWN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
               grpc.StatusCode.UNKNOWN)


def _relay_error(hop: str, err: grpc.aio.AioRpcError) -> Exception:
    """Keep a downstream status that the caller can act on; name the hop that failed."""
    from mesh.errors import MeshError

    exc = MeshError(f"{hop}: {err.details()}")
    exc.code = err.code() if err.code() != grpc.StatusCode.UNKNOWN else grpc.StatusCode.INTERNAL
    return exc
