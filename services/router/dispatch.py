"""Dispatcher: one Generate request's way through the router, failover included.

    session history merged  ->  version chosen  ->  tokenized  ->  admitted (a native key's tokens)  ->  attempts:
        plan (failover) -> pick (policy) -> relay one engine call (relay.py) -> outcome
    ->  the turn stored in the session

Where and whether to try again is failover's decision (services/router/failover), which replica
the policy's; this module carries the decisions out.  A replica that fails is left behind;
mid-stream, another replica of the same model continues from the tokens already sent
(`resume_ids`); before the first token, a fallback model may take over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from mesh.chat import Message
from mesh.errors import InvalidArgument, NotFound, Unavailable
from mesh.prefix import block_hashes, tenant_salt
from mesh.telemetry import outgoing_metadata, span_context, tracer
from meshpb.v1 import common_pb2, engine_pb2, router_pb2
from services.router import metrics
from services.router.config import RouterConfig
from services.router.engines import Engines
from services.router.events import RECENT
from services.router.failover import Call, Failover, Plan
from services.router.policies import AffinityRouter, RouteRequest
from services.router.relay import EngineFailed, Stream, attempt
from services.router.replicas import Replica, ReplicaTable
from services.router.sessions import merge, session_key
from services.router.shadow import FALLBACK, Deadline, Shadows
from services.router.upstream import Sessions, Tokenizer, relay_error
from services.router.versions import ModelVersions, resolve_model, unit_interval

log = logging.getLogger(__name__)

Request = router_pb2.RouterGenerateRequest
Reply = router_pb2.RouterGenerateResponse


class Dispatcher:
    def __init__(self, config: RouterConfig, table: ReplicaTable, policy: AffinityRouter, failover: Failover,
                 versions: ModelVersions, engines: Engines, tokenizer: Tokenizer, sessions: Sessions):
        self.config, self.table, self.policy, self.failover = config, table, policy, failover
        self.versions, self.engines, self.tokenizer, self.sessions = versions, engines, tokenizer, sessions
        self.shadows = Shadows()
        failover.agreement.live = self.shadows.agreement     # fallback mirrors: measured confidence

    async def generate(self, request: Request, request_id: str, incoming: list[Message],
                       context: grpc.aio.ServicerContext, admit: Callable[[int], None] | None = None
                       ) -> AsyncGenerator[Reply, None]:
        """The whole request; `incoming`: its chat messages; `admit`, when given, is handed the prompt's
        token count once it is tokenized, before any engine call, and may refuse (raise MeshError).
        Raises MeshError (Saturated when no replica of the model's chain can take it)."""
        model, pinned_version = resolve_model(request.model, request.model_version, self.config.default_model,
                                              self.table.models())
        # Everything kept per conversation is the caller's own: keyed by tenant and session id.
        key = session_key(request.tenant, request.session_id)
        session = key if request.WhichOneof("input") == "chat" else ""
        conversation, new = merge(await self.sessions.history(session), incoming)
        version = self.choose_version(model, pinned_version, request, key)
        trace.get_current_span().set_attributes({"policy": self.config.policy,
                                                 "session_messages": len(conversation) - len(new)})
        mirrors = [m for m in (self._mirror(request, request_id, model, version, pinned_version, conversation, key,
                                            context),
                               self._mirror_fallback(request, request_id, model, pinned_version, conversation,
                                                     context)) if m is not None]
        started = time.monotonic()
        answer: list[str] = []        # a resumed stream's text already sent comes first (_prepare)
        try:
            async for reply in self._attempts(request, request_id, model, version, conversation, key, context,
                                              answer, request.priority == common_pb2.PRIORITY_INTERACTIVE, admit):
                answer.append(reply.text)
                if reply.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    await self.sessions.remember(session, [*new, Message("assistant", "".join(answer))])
                    # Before the last message (the caller may close us after it).  A degraded answer is
                    # a fallback's, not the primary's: no mirror compares with it.
                    served = None if reply.served_by.degraded else ("".join(answer), time.monotonic() - started)
                    for mirror in mirrors:
                        mirror.set_result(served)
                yield reply
        finally:
            for mirror in mirrors:
                if not mirror.done():
                    mirror.set_result(None)       # failed or left: nothing to compare the mirror with

    def _mirror(self, request: Request, request_id: str, model: str, version: str, pinned_version: str,
                conversation: list[Message], key: str, context: grpc.aio.ServicerContext
                ) -> asyncio.Future[tuple[str, float] | None] | None:
        """Shadow traffic (shadow.py): start the mirror of an unpinned request picked by the model's
        shadow share; its outcome is compared, never sent.  None when this request is not mirrored."""
        if pinned_version or request.pinned_replica or request.resume_ids or not version:
            return None
        shadow = self.versions.mirror(model, version, {r.model_version for r in self.table.serving(model)},
                                      key or request_id)
        if not shadow:
            return None
        copy = Request()
        copy.CopyFrom(request)
        copy.session_id = ""                    # the mirror stores nothing and follows no session
        deadline = Deadline(context.time_remaining())
        return self.shadows.start(model, shadow, lambda: self._attempts(
            copy, f"{request_id}~shadow", model, shadow, conversation, "", deadline, [], False))  # type: ignore[arg-type]

    def _mirror_fallback(self, request: Request, request_id: str, model: str, pinned_version: str,
                         conversation: list[Message], context: grpc.aio.ServicerContext
                         ) -> asyncio.Future[tuple[str, float] | None] | None:
        """--fallback-shadow-share: mirror this share of the model's unpinned requests to its fallback
        model, whose agreement with the answer is the shadow evidence of failover/agreement.py."""
        steps = self.failover.chain.steps(model)
        share = self.config.fallback_shadow_share
        if not share or len(steps) < 2 or pinned_version or request.pinned_replica or request.resume_ids \
                or unit_interval("fallback-shadow:" + request_id) >= share:
            return None
        fallback, copy = steps[1].model, Request()
        copy.CopyFrom(request)
        copy.session_id = ""
        deadline = Deadline(context.time_remaining())

        async def run() -> AsyncIterator[Reply]:
            async for reply in self._attempts(copy, f"{request_id}~fallback", fallback, "", conversation, "",
                                              deadline, [], False):  # type: ignore[arg-type]
                if reply.served_by.model and reply.served_by.model != fallback:
                    raise Unavailable(f"{fallback!r} had no replica for the mirror")   # its own fallback's: no evidence
                yield reply

        return self.shadows.start(model, FALLBACK + fallback, run)

    def choose_version(self, model: str, pinned_version: str, request: Request, key: str) -> str:
        """The version this request runs on; "" when any will do (a pinned replica, or none serving:
        then failover decides, possibly for a fallback model).  `key`: its session's (sessions.session_key)."""
        if pinned_version:
            if pinned_version not in {r.model_version for r in self.table.all() if r.model == model}:
                raise NotFound(f"version {pinned_version!r} of {model!r} is not served")
            return pinned_version
        served = {r.model_version for r in self.table.serving(model)}
        if request.pinned_replica or not served:
            return ""
        return self.versions.choose(model, served, "", key or request.request_id)

    def cache_salt(self, request: Request) -> bytes:
        """The prefix-cache namespace of `request` (engine and shared KV cache, and the router's prefix
        affinity): its tenant's, so no caller learns another's prompts from cache hits; empty (shared
        by everyone) with --prefix-sharing global."""
        return tenant_salt(request.tenant) if self.config.prefix_sharing == "tenant" else b""

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

    async def _prepare(self, request: Request, model: str, conversation: list[Message], key: str,
                       deadline_s: float | None = None, sent: list[str] | None = None
                       ) -> tuple[list[int], Stream, RouteRequest]:
        """Token ids, a client stream and the routing request, for `model`'s tokenizer; the stream
        starts after the request's `resume_ids` (their text appended to `sent`)."""
        prompt_ids = await self.tokenizer.tokenize(request, model, conversation, deadline_s)
        stream = Stream(await self.tokenizer.decoder(model), request.sampling.stop, len(prompt_ids),
                        request.include_token_ids)
        if request.resume_ids:
            text = stream.resume(request.resume_ids)
            if sent is not None:
                sent.append(text)
        route = RouteRequest(model, session_key=key, region=request.region,
                             prefix_hashes=tuple(block_hashes(prompt_ids, self.table.block_size,
                                                              salt=self.cache_salt(request))))
        return prompt_ids, stream, route

    async def _attempts(self, request: Request, request_id: str, model: str, version: str,
                        conversation: list[Message], key: str, context: grpc.aio.ServicerContext,
                        sent: list[str], interactive: bool = True, admit: Callable[[int], None] | None = None
                        ) -> AsyncIterator[Reply]:
        """Attempts until the stream finishes, within the call's attempts and the retry budget.
        interactive: an interactive-priority request, not a mirror (level 3 by latency: failover/latency.py).
        admit: see `generate` (a fallback model's own tokenization later does not admit again: the
        settlement goes by the real usage)."""
        root = trace.get_current_span()                # router.generate: it carries the final decision
        prompt_ids, stream, route = await self._prepare(request, model, conversation, key, context.time_remaining(),
                                                        sent)
        if admit is not None:
            admit(len(prompt_ids))
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
        call = Call(self.failover, model, now(), interactive)
        for event in self.failover.latency.take_events():
            log.warning("%s", event)
        streamed = model                               # the model whose tokens `stream` holds
        try:
            for _ in range(4 * self.failover.config.max_attempts):
                pool = [r for r in self.table.all() if not r.draining and
                        (r.model != model or not version or r.model_version == version)]
                if stream.ids:                         # a stream continues on the model it started with
                    pool = [r for r in pool if r.model == streamed]
                plan = call.plan(pool, now(), context.time_remaining())
                if plan.model != streamed:             # nothing sent yet: the fallback model's own prompt
                    if plan.degraded:
                        metrics.FAILOVER.labels("3").inc()
                        RECENT.record("degraded", model, "", f"to {plan.model} ({plan.degraded_by}): {plan.why}")
                    prompt_ids, stream, route = await self._prepare(request, plan.model, conversation, key,
                                                                    context.time_remaining())
                    streamed = plan.model
                decision = self.policy.pick(plan.candidates, route, now())
                started_attempt = call.start(decision.replica, now())
                if started_attempt is None:            # its last probe slot went meanwhile: plan again
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
                        RECENT.record("isolated", model, exc.replica_id, exc.reason)
                    limit = request.sampling.max_tokens
                    if limit and len(stream.ids) >= limit:     # died after the last token, before its final message
                        call.succeeded(started_attempt, now(), first_token_s)
                        _count_degraded(model, plan)
                        yield stream.finish_at_length(served_by(decision.replica, plan))
                        return
                    if not call.failed(started_attempt, now(), first_token_s):
                        raise Unavailable(f"{exc}; no attempt or retry budget left for this request") from None
                    metrics.FAILOVER.labels("2").inc()
                    RECENT.record("failover", model, decision.replica.replica_id,
                                  f"{exc} after {len(stream.ids)} token(s)")
                    log.warning("request %s: %s after %d token(s); trying another replica",
                                request_id, exc, len(stream.ids))
                    continue
                except BaseException:                   # the client left, or a request error: no replica's fault
                    call.cancelled(started_attempt, now())
                    raise
                call.succeeded(started_attempt, now(), first_token_s)
                RECENT.first_token(first_token_s)
                _count_degraded(model, plan)
                return
            raise Unavailable(f"no replica could be started for {model!r}; retry shortly")
        finally:
            call.close(now())

    async def _attempt(self, replica: Replica, plan: Plan, reason: str, request: Request, request_id: str,
                       prompt_ids: list[int], stream: Stream, route: RouteRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[Reply]:
        """One engine call for the stream (resuming from its tokens), with the replica's bookkeeping."""
        metrics.ROUTED.labels(plan.model, replica.model_version, replica.replica_id, reason).inc()
        # Not made current: this generator is suspended at every yield, and its caller's code
        # runs meanwhile; the engine learns its parent from the metadata instead.
        span = tracer().start_span("router.attempt", kind=trace.SpanKind.CLIENT, attributes={
            **_decision(replica, plan, reason, None), "resumed_tokens": len(stream.ids)})
        engine_request = engine_pb2.GenerateRequest(
            request_id=request_id, model=plan.model, prompt_ids=prompt_ids, sampling=request.sampling,
            priority=request.priority, resume_ids=stream.ids, cache_salt=self.cache_salt(request),
            cache_class=request.cache_class)
        if stream.ids:      # resuming: the prompt's logprobs went out with the first attempt's first message
            engine_request.sampling.prompt_logprobs = False
        replica.in_flight += 1
        metrics.IN_FLIGHT.labels(replica.replica_id).inc()
        started, ok = time.monotonic(), True
        self.policy.on_start(replica, route, started)

        def admitted() -> bool:
            return replica.healthy and self.failover.isolation(replica.replica_id) is None

        try:
            async for reply in attempt(self.engines.stub(replica.address), replica.replica_id, engine_request,
                                       stream, served_by(replica, plan), outgoing_metadata(context=span_context(span)),
                                       context.time_remaining(), self.config.first_token_timeout_s,
                                       self.config.stall_timeout_s, relay_error, admitted):
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


def served_by(replica: Replica, plan: Plan) -> common_pb2.ServedBy:
    return common_pb2.ServedBy(replica=replica.replica_id, model=plan.model, model_version=replica.model_version,
                               region=replica.region, degraded=plan.degraded, confidence=plan.confidence,
                               confidence_source=plan.confidence_source if plan.degraded else "",
                               degraded_by=plan.degraded_by)


def _decision(replica: Replica, plan: Plan, reason: str, failover_attempts: int | None) -> dict[str, Any]:
    """The routing decision as span attributes (router.generate and router.attempt)."""
    attrs: dict[str, Any] = {"replica": replica.replica_id, "model_version": replica.model_version,
                             "served_model": plan.model, "region": replica.region, "reason": reason,
                             "degraded": plan.degraded, "confidence": plan.confidence}
    if plan.degraded:
        attrs.update(degraded_by=plan.degraded_by, confidence_source=plan.confidence_source)
    if failover_attempts is not None:
        attrs["failover_attempts"] = failover_attempts
    return attrs


def _count_degraded(model: str, plan: Plan) -> None:
    if plan.degraded:
        metrics.DEGRADED.labels(model, plan.model, plan.degraded_by or "capacity").inc()
