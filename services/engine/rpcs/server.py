"""Engine gRPC servicer: pb <-> engine types, the Generate stream, Abort, load and info.

One loop task runs engine.step() in the step thread whenever there is work and hands each output
to its request's queue.  A step that raises fails every request the engine holds
(engine.fail_step(): FinishReason.ERROR, which Generate turns into INTERNAL); the requests that step
did not run, and the loop, go on.

With a shared KV cache (`remote`), Generate fetches the prompt blocks this engine lacks before
adding the request, and a publisher task sends the blocks the engine computed; neither is ever
on the step thread, and neither can fail a request (services/engine/rpcs/remote_cache.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace

from mesh import peers
from mesh.constraints import Constraint
from mesh.errors import InvalidArgument, ResourceExhausted, Unavailable
from mesh.grpcutil import Service, rpc_errors
from mesh.models.folder import sampling_defaults
from mesh.telemetry import outgoing_metadata, server_span, span_between, span_context
from meshpb.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine import metrics
from services.engine.config import EngineConfig
from services.engine.core.request import FinishReason, Owner, Request, StepOutput
from services.engine.engine import Engine, Timing
from services.engine.rpcs.adapters import AdapterRPCs
from services.engine.rpcs.convert import output_to_pb, sampling_from_pb
from services.engine.rpcs.lifecycle import Lifecycle
from services.engine.rpcs.remote_cache import RemoteCache
from services.engine.runtime.grammar_limits import CompileRefused, ConstraintRefused

log = logging.getLogger(__name__)

class EngineServicer(Lifecycle, AdapterRPCs, engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: Engine, config: EngineConfig, remote: RemoteCache | None = None,
                 step_thread: ThreadPoolExecutor | None = None):
        self.engine = engine
        self.config = config
        self.remote = remote
        # The model's own sampling values (generation_config.json), for requests that leave theirs unset.
        self.sampling_defaults = sampling_defaults(engine.runner.folder)
        self._staging: dict[str, Request] = {}     # requests that came with fetched KV (until it is imported)
        self._publish_wakeup = asyncio.Event()
        self._publisher: asyncio.Task[None] | None = None
        self.queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self._wakeup = asyncio.Event()
        self._loading = asyncio.Lock()             # one LoadVersion builds weights at a time
        self.draining = False                      # Drain: no new work, then out of discovery
        self.set_serving: Callable[[bool], Awaitable[None]] | None = None    # the Service's health
        self.withdraw: Callable[[], Awaitable[None]] | None = None           # leave discovery
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None
        # Always the same thread, the one that loaded the model (services/engine/__main__.py): OpenMP
        # keeps a worker team per thread that starts parallel work, and two teams compete for the cores.
        self._step_thread = step_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self.metrics = metrics.ReplicaMetrics(config.replica_id)
        self.metrics.set_plan(engine.runner.plan)
        self.metrics.watch_tenants(engine.stats)
        if remote is not None:
            self.metrics.watch_shared_cache(remote, engine.outbox)

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run_loop())
        if self.remote is not None and self.engine.outbox is not None:
            self._publisher = asyncio.create_task(self.remote.run_publisher(self.engine.outbox, self._publish_wakeup))

    async def close(self) -> None:
        self._stopping = True
        for task in (self._loop_task, self._publisher):
            if task is not None:
                task.cancel()
        self._step_thread.shutdown(wait=False, cancel_futures=True)
        self.metrics.close()
        if self.remote is not None:
            await self.remote.close()

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wakeup.wait(), 1.0)
            except TimeoutError:              # idle: an old model version whose last request has gone
                if len(self.engine.versions.models) > 1:
                    self.engine.versions.release_unused()
                continue
            self._wakeup.clear()              # a request added from here on sets it again
            if self.engine.has_work():
                await loop.run_in_executor(self._step_thread, self._steps, loop)

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the step thread: step while there is work, handing each step's outputs to the event loop
        without waiting for it, so the next step starts at once (the loop sends the tokens meanwhile)."""
        while self.engine.has_work() and not self._stopping:
            try:
                outputs = self.engine.step()
            except Exception:
                # A model failure must not kill the loop: fail the requests in flight, keep serving.
                log.exception("engine step failed")
                outputs = self.engine.fail_step()
            loop.call_soon_threadsafe(self._deliver, outputs, time.monotonic())

    def _deliver(self, outputs: list[StepOutput], now: float) -> None:
        self._observe_step()
        if self.engine.outbox:
            self._publish_wakeup.set()
        self.metrics.recent.generated(now, outputs)
        for out in outputs:
            queue = self.queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _observe_step(self) -> None:
        engine, blocks, stats = self.engine, self.engine.blocks, self.engine.stats
        self.metrics.observe_step(engine.num_running, engine.num_waiting, blocks.num_used_blocks,
                                  blocks.num_free_blocks, blocks.queries, blocks.hits, stats.preemptions,
                                  stats.last_step_s, stats.last_step_tokens, stats.last_batch_size,
                                  stats.draft_tokens, stats.accepted_tokens, stats.draft_speedup)

    async def _match(self, req: Request, constraint: Constraint, tenant: bytes) -> None:
        """`req`'s grammar matcher, counted by outcome; a cache hit on the loop: no thread, so compiles
        waiting for theirs never delay it."""
        grammars = self.engine.grammars
        try:
            cached = None if req.resume_ids else grammars.cached_matcher(constraint)
            matcher = cached if cached is not None else \
                await asyncio.to_thread(grammars.matcher, constraint, req.resume_ids, tenant)
        except (CompileRefused, ConstraintRefused) as exc:
            self.metrics.constrained(exc.reason)
            raise
        req.matcher = matcher
        self.metrics.constrained("cached" if matcher.cached else "compiled")

    @rpc_errors
    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        peers.require(context, "Generate", peers.ENGINE)
        request_id = request.request_id or uuid.uuid4().hex
        if self.draining:
            raise Unavailable(f"engine {self.config.replica_id} is draining; another replica takes new requests")
        if request_id in self.queues:
            raise InvalidArgument(f"request_id {request_id!r} is already in flight on this engine")
        with server_span("engine.generate", context, request_id=request_id,
                         prompt_tokens=len(request.prompt_ids)) as span:
            req = self.engine.make_request(request_id, list(request.prompt_ids),
                                           sampling_from_pb(request.sampling, self.sampling_defaults),
                                           list(request.resume_ids),
                                           Owner(int(request.priority), request.tenant, request.weight or 1.0),
                                           cache_salt=request.cache_salt, cache_class=request.cache_class,
                                           adapter=request.adapter)
            queue: asyncio.Queue[StepOutput] = asyncio.Queue()
            self.queues[request_id] = queue
            call = self.metrics.request(request.adapter)    # its tokens, first-token and per-token times, outcome
            try:
                if req.sampling.constraint is not None:   # compiled off the event loop and the step thread
                    try:
                        # The raw cache_salt (req's has the model version's salt added) is the tenant whose
                        # compile rate a miss spends.
                        await self._match(req, req.sampling.constraint, request.cache_salt)
                    except (CompileRefused, ConstraintRefused):
                        call.outcome = "rejected"           # rpc_errors sends its retry-after and caller mark
                        raise
                if self.remote is not None:
                    await self._fetch_prefix(req, span)
                try:
                    self.engine.add(req)
                except ResourceExhausted:
                    call.outcome = "rejected"
                    raise
                self._wakeup.set()
                while True:
                    out = _coalesced(await queue.get(), queue)
                    call.generated(len(out.new_ids))
                    if out.finish_reason is FinishReason.ERROR:
                        call.outcome = "error"
                        await context.abort(grpc.StatusCode.INTERNAL,
                                            f"engine {self.config.replica_id} failed while running the model")
                    if out.finish_reason is None:
                        yield output_to_pb(out)
                        continue
                    # The last message: recorded before it goes, since a caller that has it may close the
                    # stream at once, and this generator is then never resumed past the yield.
                    span.set_attributes({"completion_tokens": out.completion_tokens,
                                         "cached_tokens": out.cached_tokens, "finish_reason": out.finish_reason.value})
                    call.ended(out.finish_reason.value, len(req.output_ids))
                    with contextlib.suppress(GeneratorExit):     # closed after the last message: delivered
                        yield output_to_pb(out)
                    return
            finally:
                # Reached on completion and on cancellation (the caller went away).
                self.queues.pop(request_id, None)
                self._staging.pop(request_id, None)
                if req.finish_reason is None:
                    self.engine.abort(request_id)
                    self._wakeup.set()
                timing = self.engine.pop_timing(request_id)
                call.closed(timing)
                if timing is not None:
                    self._trace_phases(span, timing, len(req.prompt_ids), req.num_cached_tokens,
                                       len(req.output_ids))

    async def _fetch_prefix(self, req: Request, span: trace.Span) -> None:
        """Stage the prompt blocks this engine lacks and the shared cache holds (the scheduler imports them)."""
        assert self.remote is not None
        if self.engine.num_waiting >= self.engine.max_waiting:
            return                                  # engine.add will refuse it: fetch nothing in vain
        start, hashes = self.engine.uncached_prefix(req.all_ids, req.cache_salt)
        # Fetched KV waits in memory until its request is admitted: bounded, beyond it requests recompute.
        room = (self.config.cache_staging_mb << 20) - self._staged_bytes()
        hashes = hashes[:max(0, room) // self.remote.layout.block_bytes]
        if not hashes:
            return
        fetch_ns = time.time_ns()
        req.staged = await self.remote.fetch(start, hashes, outgoing_metadata(context=span_context(span)),
                                             model_version=req.version)
        if req.staged:
            self._staging[req.request_id] = req
        span_between("engine.kv_fetch", fetch_ns, time.time_ns(), span, local_blocks=start,
                     missing_blocks=len(hashes), fetched_blocks=len(req.staged))

    def _staged_bytes(self) -> int:
        # req.staged is swapped for [] by the step thread at admission: reading it here is safe.
        for request_id in [r for r, req in self._staging.items() if not req.staged]:
            del self._staging[request_id]
        return sum(b.kv.nbytes for req in self._staging.values() for b in req.staged)

    def _trace_phases(self, span: trace.Span, timing: Timing, prompt_tokens: int, cached_tokens: int,
                      generated: int) -> None:
        """Child spans of engine.generate for the request's phases, at the times the engine saw them
        (the step loop is shared by every request in the batch, so it cannot be wrapped per request)."""
        end = timing.finished_ns or time.time_ns()
        scheduled = timing.scheduled_ns
        span_between("engine.queue", timing.arrival_ns, scheduled or end, span)
        if scheduled:
            span_between("engine.prefill", scheduled, timing.first_token_ns or end, span,
                         prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)
        if timing.first_token_ns:
            span_between("engine.decode", timing.first_token_ns, end, span, completion_tokens=generated)

    @rpc_errors
    async def Abort(self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> engine_pb2.AbortResponse:
        peers.require(context, "Abort", peers.ENGINE)
        found = self.engine.abort(request.request_id)
        self._wakeup.set()
        return engine_pb2.AbortResponse(found=found)

    def load_report(self) -> common_pb2.LoadReport:
        recent = self.metrics.recent.figures(time.monotonic())
        held = self.engine.adapters.held()
        return common_pb2.LoadReport(
            replica_id=self.config.replica_id,
            running=self.engine.num_running,
            waiting=self.engine.num_waiting,
            qps=recent.qps,
            p50_latency_ms=recent.p50_latency_ms,
            p99_latency_ms=recent.p99_latency_ms,
            tokens_per_second=recent.tokens_per_second,
            kv_blocks_total=self.engine.blocks.num_blocks,
            kv_blocks_free=self.engine.blocks.num_free_blocks,
            unix_ms=int(time.time() * 1000),
            tenants=[common_pb2.TenantLoad(tenant=t.tenant, running=t.running, waiting=t.waiting, tokens=t.tokens)
                     for t in self.engine.stats.tenants[:16]],
            adapters=list(held),
            adapter_paths=list(held.values()),
        )

    @rpc_errors
    async def WatchLoad(self, request: engine_pb2.LoadRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[common_pb2.LoadReport]:
        peers.require(context, "WatchLoad", peers.ENGINE)
        interval = max(request.interval_ms, 50) / 1000.0
        while True:
            yield self.load_report()
            await asyncio.sleep(interval)

    @rpc_errors
    async def GetInfo(self, request: engine_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
                      ) -> engine_pb2.EngineInfo:
        peers.require(context, "GetInfo", peers.ENGINE)
        runner = self.engine.runner
        plan = runner.plan
        return engine_pb2.EngineInfo(
            replica_id=self.config.replica_id,
            model=self.config.model,
            model_version=self.engine.versions.active,
            loaded_versions=self.engine.versions.loaded(),
            adapters=self.engine.adapters.names(),
            region=self.config.region,
            dtype=plan.dtype,
            device=plan.device,
            max_context=runner.max_context,
            block_size=runner.block_size,
            kv_blocks_total=runner.num_blocks,
            max_batch=self.engine.scheduler.config.max_running,
            max_waiting=self.engine.max_waiting,
            plan=engine_pb2.ExecutionPlan(device=plan.device, dtype=plan.dtype, matmul=plan.matmul,
                                          attention=plan.attention, ops=plan.ops, graphs=plan.graphs,
                                          matmul_large=plan.matmul_large, split_rows=plan.split_rows,
                                          kv_dtype=plan.kv_dtype or plan.dtype),
        )


def add_to(service: Service, servicer: EngineServicer) -> None:
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, service.server)


def _coalesced(out: StepOutput, queue: asyncio.Queue[StepOutput]) -> StepOutput:
    """`out` with the outputs queued behind it (steps that ran while this stream was still sending) as one
    message, tokens in order: under load every hop (router, edge, client) handles fewer messages per token."""
    while out.finish_reason is None and not queue.empty():
        later = queue.get_nowait()
        out = dataclasses.replace(later, new_ids=out.new_ids + later.new_ids, logprobs=out.logprobs + later.logprobs,
                                  prompt_logprobs=out.prompt_logprobs + later.prompt_logprobs)
    return out
