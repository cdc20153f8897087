"""Dispatcher: one Generate request's way through the router, failover included.

    session history merged  ->  version chosen  ->  tokenized  ->  admitted (a native key's tokens)  ->  attempts:
        next try (failover/attempts.py: plan, pick) -> relay one engine call (relay.py) -> its outcome, back
    ->  the turn stored in the session

Where and whether to try again is failover's decision (services/router/failover, whose Attempts
answers each try's outcome with the next step), which replica the policy's; this module carries the
decisions out.  A replica that fails is left behind; mid-stream, another replica of the same model
continues from the tokens already sent (`resume_ids`); before the first token, a fallback model may
take over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from mesh.chat import Message
from mesh.errors import InvalidArgument, MeshError, NotFound, Unavailable
from mesh.prefix import block_hashes, tenant_salt
from mesh.sampling import at_tokenizer
from mesh.telemetry import outgoing_metadata, span_context, tracer
from services.router import metrics
from services.router.config import RouterConfig
from services.router.decisions import count_degraded, decision_attributes, record_fallback, served_by
from services.router.engines import EngineRequest, Engines
from services.router.events import RECENT
from services.router.failover import Call, Failover, Plan
from services.router.failover.attempts import (
    Attempts,
    Busy,
    Event,
    Failure,
    FinishAtLength,
    Finished,
    Isolated,
    Prepare,
    Try,
)
from services.router.hop import Hop, Prompt, mirror_hop
from services.router.lora import LoraAdapters
from services.router.policies import AffinityRouter, RouteRequest
from services.router.relay import EngineCall, EngineFailed, Stream, attempt
from services.router.replicas import Replica, ReplicaTable
from services.router.request import BATCH, INTERACTIVE, Reply, RouterRequest
from services.router.sessions import merge, session_key
from services.router.shadow import FALLBACK, Shadows
from services.router.upstream import Sessions, Tokenizer, relay_error
from services.router.versions import ModelVersions, resolve_model, unit_interval

log = logging.getLogger(__name__)

class Dispatcher:
    def __init__(self, config: RouterConfig, table: ReplicaTable, policy: AffinityRouter, failover: Failover,
                 versions: ModelVersions, engines: Engines, tokenizer: Tokenizer, sessions: Sessions):
        self.config, self.table, self.policy, self.failover = config, table, policy, failover
        self.versions, self.engines, self.tokenizer, self.sessions = versions, engines, tokenizer, sessions
        self.lora = LoraAdapters(table, engines)          # the adapters requests may name (lora.py)
        self.shadows = Shadows()
        failover.agreement.live = self.shadows.agreement     # fallback mirrors: measured confidence

    async def generate(self, request: RouterRequest, request_id: str, context: grpc.aio.ServicerContext,
                       admit: Callable[[int], None] | None = None) -> AsyncGenerator[Reply, None]:
        """The whole request (`request_id`: its own or one made up); `admit`, when given, is handed the prompt's
        token count once it is tokenized, before any engine call, and may refuse (raise MeshError).
        Raises MeshError (Saturated when no replica of the model's chain can take it)."""
        named, lora = self.lora.resolve(request.model)      # a LoRA adapter's name: its base model, with it
        model, pinned_version = resolve_model(named, request.model_version, self.config.default_model,
                                              self.table.models())
        if lora is not None:     # a resumed stream pins the version its answer named: the adapter's
            pinned_version = self.lora.base_version(lora, pinned_version)
        # Everything kept per conversation is the caller's own: keyed by tenant and session id.
        key = session_key(request.tenant, request.session_id)
        chat = request.input == "chat"
        session = key if chat else ""
        history, branched = await self.sessions.continued(request.tenant, request.history_from, session, chat)
        conversation, new = merge(history, request.messages)
        version = self.choose_version(model, pinned_version, request, key)
        trace.get_current_span().set_attributes({"policy": self.config.policy,
                                                 "session_messages": len(conversation) - len(new)})
        answer: list[str] = []        # a resumed stream's text already sent comes first (_prepare)
        hop = Hop(request, request_id, model, version, conversation, key, context, answer,
                  request.priority == INTERACTIVE, admit, lora)
        mirrors = [m for m in (self._mirror(hop, pinned_version), self._mirror_fallback(hop, pinned_version))
                   if m is not None]
        started = time.monotonic()
        try:
            async for reply in self._attempts(hop):
                answer.append(reply.text)
                if reply.finish_reason:
                    if not request.caller_stores_turn:      # else the caller stores what it gave out (StoreTurn)
                        await self.sessions.remember_turn(session, history, branched, new,
                                                          Message("assistant", "".join(answer)))
                    # Before the last message (the caller may close us after it).  A degraded answer is
                    # a fallback's, not the primary's: no mirror compares with it.
                    degraded = reply.served_by is not None and reply.served_by.degraded
                    served = None if degraded else ("".join(answer), time.monotonic() - started)
                    for mirror in mirrors:
                        mirror.set_result(served)
                yield reply
        finally:
            for mirror in mirrors:
                if not mirror.done():
                    mirror.set_result(None)       # failed or left: nothing to compare the mirror with

    def _mirror(self, hop: Hop, pinned_version: str) -> asyncio.Future[tuple[str, float] | None] | None:
        """Shadow traffic (shadow.py): start the mirror of an unpinned request picked by the model's
        shadow share; its outcome is compared, never sent.  None when this request is not mirrored."""
        request, model, version = hop.request, hop.model, hop.version
        if pinned_version or request.pinned_replica or request.resume_ids or not version:
            return None
        shadow = self.versions.mirror(model, version, {r.model_version for r in self.table.serving(model)},
                                      hop.key or hop.request_id)
        if not shadow:
            return None
        mirror = mirror_hop(hop, f"{hop.request_id}~shadow", model, shadow)
        return self.shadows.start(model, shadow, lambda: self._attempts(mirror))

    def _mirror_fallback(self, hop: Hop, pinned_version: str) -> asyncio.Future[tuple[str, float] | None] | None:
        """--fallback-shadow-share: mirror this share of the model's unpinned requests to its fallback
        model, whose agreement with the answer is the shadow evidence of failover/agreement.py."""
        request, steps = hop.request, self.failover.chain.steps(hop.model)
        share = self.config.fallback_shadow_share
        if not share or len(steps) < 2 or pinned_version or request.pinned_replica or request.resume_ids \
                or unit_interval("fallback-shadow:" + hop.request_id) >= share:
            return None
        fallback = steps[1].model
        mirror = mirror_hop(hop, f"{hop.request_id}~fallback", fallback, "")

        async def run() -> AsyncIterator[Reply]:
            async for reply in self._attempts(mirror):
                if reply.served_by is not None and reply.served_by.model and reply.served_by.model != fallback:
                    raise Unavailable(f"{fallback!r} had no replica for the mirror")   # its own fallback's: no evidence
                yield reply

        return self.shadows.start(hop.model, FALLBACK + fallback, run)

    def choose_version(self, model: str, pinned_version: str, request: RouterRequest, key: str) -> str:
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

    def cache_salt(self, request: RouterRequest) -> bytes:
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

    async def _prepare(self, hop: Hop, model: str, sent: list[str] | None = None) -> Prompt:
        """Token ids, a client stream and the routing request, for `model`'s tokenizer; the stream
        starts after the request's `resume_ids` (their text appended to `sent`)."""
        request = hop.request
        prompt_ids, reasoning = await self.tokenizer.tokenize(request, model, hop.conversation,
                                                             hop.context.time_remaining())
        sampling, prompt_ids = await at_tokenizer(
            request.sampling, prompt_ids,
            lambda text: self.tokenizer.encode_text(model, text, hop.context.time_remaining()))
        stream = Stream(await self.tokenizer.decoder(model), request.sampling.stop, len(prompt_ids),
                        request.include_token_ids, reasoning)
        if request.resume_ids:
            text = stream.resume(request.resume_ids)
            if sent is not None:
                sent.append(text)
        salt = self.cache_salt(request) + (b"|lora:" + hop.lora.name.encode() if hop.lora else b"")
        route = RouteRequest(model, session_key=hop.key, region=request.region, tenant=request.tenant,
                             prefix_hashes=tuple(block_hashes(prompt_ids, self.table.block_size, salt=salt)))
        return Prompt(prompt_ids, stream, route, sampling)

    async def _attempts(self, hop: Hop) -> AsyncIterator[Reply]:
        """Attempts until the stream finishes, within the call's attempts and the retry budget
        (`hop.admit`: see `generate`; a fallback model's own tokenization later does not admit again:
        the settlement goes by the real usage)."""
        root = trace.get_current_span()                # router.generate: it carries the final decision
        prompt = await self._prepare(hop, hop.model, hop.sent)
        if hop.admit is not None:
            hop.admit(len(prompt.ids))
        if hop.request.pinned_replica:                 # operators and tests: exactly there, or an error
            async for reply in self._pinned_attempt(hop, prompt, root):
                yield reply
            return
        model, now = hop.model, time.monotonic
        call = Call(self.failover, model, now(), hop.interactive)
        for event in self.failover.latency.take_events():
            log.warning("%s", event)
        attempts = Attempts(call, lambda streamed, failed: self._pool(hop, streamed, failed), self.policy.pick,
                            prompt.route, len(prompt.stream.ids), hop.request.sampling.max_tokens)
        try:
            while True:
                step = attempts.next(now(), hop.context.time_remaining())
                if isinstance(step, Prepare):          # nothing sent yet: the fallback model's own prompt
                    record_fallback(model, step.plan)
                    prompt = await self._prepare(hop, step.plan.model)
                    attempts.prepared(prompt.route, len(prompt.stream.ids))
                elif isinstance(step, Try):
                    root.set_attributes(decision_attributes(step.replica, step.plan, step.reason,
                                                            step.failover_attempts))
                    try:
                        async for reply in self._attempt(hop, prompt, step.replica, step.plan, step.reason):
                            attempts.replied(now())
                            yield reply
                    except EngineFailed as exc:
                        self._record(hop, attempts.failed(_failure(exc), len(prompt.stream.ids), now()))
                    except BaseException:               # the client left, or a request error: no replica's fault
                        attempts.cancelled(now())
                        raise
                    else:
                        attempts.succeeded(now())
                elif isinstance(step, Finished):
                    RECENT.first_token(step.first_token_s)
                    count_degraded(model, step.plan)
                    return
                elif isinstance(step, FinishAtLength):
                    count_degraded(model, step.plan)
                    yield prompt.stream.finish_at_length(served_by(step.replica, step.plan,
                                                                   hop.adapter(step.plan.model)))
                    return
                else:
                    raise Unavailable(step.message)
        finally:
            attempts.close(now())

    def _pool(self, hop: Hop, streamed: str | None, failed: Collection[str] = ()) -> list[Replica]:
        """The replicas the next attempt may go to: not draining, of the hop's version (for its own
        model), its LoRA adapter's holders while one is free (lora.py), and of `streamed`'s model when given
        (a stream continues on the model it started with)."""
        pool = [r for r in self.table.all() if not r.draining and
                (r.model != hop.model or not hop.version or r.model_version == hop.version)]
        if hop.lora is not None:
            pool = self.lora.prefer(hop.lora.name, hop.model, pool,
                                    lambda r: not self.failover.refusal(r, time.monotonic(), failed))
        return pool if streamed is None else [r for r in pool if r.model == streamed]

    @staticmethod
    def _record(hop: Hop, events: list[Event]) -> None:
        """A failed try's failover events, in the metrics, the console's recent events and the log."""
        for event in events:
            if isinstance(event, Isolated):
                metrics.FAILOVER.labels("1").inc()
                RECENT.record("isolated", hop.model, event.replica_id, event.reason)
            elif isinstance(event, Busy):
                log.info("request %s: %s; trying another replica", hop.request_id, event.error)
            else:
                metrics.FAILOVER.labels("2").inc()
                RECENT.record("failover", hop.model, event.replica_id, f"{event.error} after {event.streamed} token(s)")
                log.warning("request %s: %s after %d token(s); trying another replica",
                            hop.request_id, event.error, event.streamed)

    async def _pinned_attempt(self, hop: Hop, prompt: Prompt, root: trace.Span) -> AsyncIterator[Reply]:
        """The one attempt of a request pinned to a replica: exactly there, or an error."""
        replica = self.pinned(hop.model, hop.request.pinned_replica)
        pinned = Plan(hop.model, [replica], False, 1.0)
        root.set_attributes(decision_attributes(replica, pinned, "pinned", 0))
        try:
            async for reply in self._attempt(hop, prompt, replica, pinned, "pinned"):
                yield reply
        except EngineFailed as exc:
            raise Unavailable(f"{exc} (the request is pinned to it)") from None

    async def _attempt(self, hop: Hop, prompt: Prompt, replica: Replica, plan: Plan, reason: str
                       ) -> AsyncIterator[Reply]:
        """One engine call for the stream (resuming from its tokens), with the replica's bookkeeping."""
        request, stream, route = hop.request, prompt.stream, prompt.route
        metrics.ROUTED.labels(plan.model, replica.model_version, replica.replica_id, reason).inc()
        # Not made current: this generator is suspended at every yield, and its caller's code
        # runs meanwhile; the engine learns its parent from the metadata instead.
        span = tracer().start_span("router.attempt", kind=trace.SpanKind.CLIENT, attributes={
            **decision_attributes(replica, plan, reason, None), "resumed_tokens": len(stream.ids)})
        sampling = prompt.sampling
        if stream.ids:      # resuming: the prompt's logprobs went out with the first attempt's first message
            sampling = dataclasses.replace(sampling, prompt_logprobs=False)
        adapter = hop.adapter(plan.model)                  # a fallback model runs without the adapter
        if adapter is not None:
            await self._load_adapter(hop, replica)
        engine_request = EngineRequest(hop.request_id, plan.model, prompt.ids, sampling, request.priority, stream.ids,
                                       self.cache_salt(request), request.cache_class, request.tenant, request.weight,
                                       adapter.name if adapter is not None else "")
        replica.in_flight += 1
        replica.tenant_in_flight[request.tenant] += 1
        metrics.IN_FLIGHT.labels(replica.replica_id).inc()
        started, ok = time.monotonic(), True
        self.policy.on_start(replica, route, started)

        def admitted() -> bool:
            return replica.healthy and self.failover.isolation(replica.replica_id) is None

        # A batch-class row waits behind interactive ones by design (the engine's scheduler, its give-way): its
        # silence is not a stall, so no token timeout moves it; a dead or hung engine still fails its health checks.
        batch = hop.request.priority == BATCH
        engine_call = EngineCall(self.engines, replica.replica_id, replica.address, engine_request,
                                 served_by(replica, plan, hop.adapter(plan.model)),
                                 outgoing_metadata(context=span_context(span)), hop.context.time_remaining(),
                                 math.inf if batch else self.config.first_token_timeout_s,
                                 math.inf if batch else self.config.stall_timeout_s, relay_error, admitted)
        try:
            async for reply in attempt(engine_call, stream):
                yield reply
        except EngineFailed as exc:
            ok = False
            metrics.FAILED.labels(replica.replica_id).inc()
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            raise
        except Exception as exc:                        # a request error relayed from the engine
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            if hop.lora is not None and self.lora.dropped(hop.lora, replica, exc):   # it restarted: load it again
                ok = False
                raise EngineFailed(replica.replica_id, f"no longer holds LoRA adapter {hop.lora.name!r}") from None
            raise
        finally:
            span.end()
            replica.in_flight -= 1
            replica.tenant_in_flight[request.tenant] -= 1
            if not replica.tenant_in_flight[request.tenant]:
                del replica.tenant_in_flight[request.tenant]
            metrics.IN_FLIGHT.labels(replica.replica_id).dec()
            now = time.monotonic()
            self.policy.on_finish(replica, route, now, now - started, ok)

    async def _load_adapter(self, hop: Hop, replica: Replica) -> None:
        """The engine call runs with the hop's LoRA adapter, loaded on `replica` first when it lacks it; a
        replica that cannot be reached for the load fails the attempt like a failed call (another may take it)."""
        assert hop.lora is not None
        try:
            await self.lora.ensure(hop.lora, replica, hop.context.time_remaining())
        except MeshError as exc:
            if exc.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            raise EngineFailed(replica.replica_id, f"could not load LoRA adapter {hop.lora.name!r}: {exc}",
                               exc.code) from None
        except TimeoutError:
            raise EngineFailed(replica.replica_id, f"took too long loading LoRA adapter {hop.lora.name!r}",
                               grpc.StatusCode.DEADLINE_EXCEEDED) from None


def _failure(exc: EngineFailed) -> Failure:
    """The engine's failure as the attempts' state machine reads it."""
    return Failure(exc.replica_id, exc.reason, str(exc), exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.isolate)
