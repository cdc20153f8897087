"""The router's servicer in-process, against fake engines, tokenizer and cache on loopback.

Every fake is a real grpc.aio server (with health), so the router runs its real code: discovery,
probes, load reports, the dispatcher's failover loop, the relay and the session store client.
The fake engines continue a fixed sequence by position (token at completion position p is
FIRST + p), so a resumed stream is only right when `resume_ids` carried the tokens already sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from mesh.discovery import Endpoint
from mesh.grpcutil import Service, channel, check_health
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
from services.router.config import RouterConfig
from services.router.server import RouterServicer

MODEL, VERSION = "m", "1"
FIRST = 100                                   # completion position p is token FIRST + p
VOCAB = {"[UNK]": 0, **{f"t{i}": i for i in range(1, 200)}}
LENGTH = common_pb2.FINISH_REASON_LENGTH


def words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


# -- fakes ------------------------------------------------------------------------------
@dataclass
class Behaviour:
    fail_after: int | None = None             # tokens sent before the call fails; None: it does not
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    final: bool = True                        # False: the last token comes without finish_reason
    stall_after: int | None = None            # tokens sent before the call goes silent (a hung process)


@dataclass
class Script:
    """What the engines do, one Behaviour per Generate call in arrival order (then: serve)."""

    behaviours: list[Behaviour] = field(default_factory=list)
    calls: list[tuple[str, engine_pb2.GenerateRequest]] = field(default_factory=list)

    def next(self) -> Behaviour:
        return self.behaviours.pop(0) if self.behaviours else Behaviour()


class FakeEngine(engine_pb2_grpc.EngineServicer):
    def __init__(self, replica_id: str, script: Script, waiting: int = 0):
        self.replica_id, self.script, self.waiting = replica_id, script, waiting

    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        self.script.calls.append((self.replica_id, request))
        behaviour = self.script.next()
        limit = request.sampling.max_tokens
        for sent, position in enumerate(range(len(request.resume_ids), limit)):
            if behaviour.fail_after is not None and sent >= behaviour.fail_after:
                await context.abort(behaviour.code, f"{self.replica_id} fails on purpose")
            if behaviour.stall_after is not None and sent >= behaviour.stall_after:
                await asyncio.sleep(3600)
            final = position == limit - 1 and behaviour.final
            yield engine_pb2.GenerateResponse(
                ids=[FIRST + position], finish_reason=LENGTH if final else common_pb2.FINISH_REASON_UNSPECIFIED,
                usage=common_pb2.Usage(prompt_tokens=len(request.prompt_ids), completion_tokens=limit)
                if final else None)
            await asyncio.sleep(0.005)        # let each message go out on its own
        if behaviour.fail_after is not None:
            await context.abort(behaviour.code, f"{self.replica_id} fails on purpose")

    async def WatchLoad(self, request: engine_pb2.LoadRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[common_pb2.LoadReport]:
        while True:
            yield common_pb2.LoadReport(replica_id=self.replica_id, waiting=self.waiting, running=1,
                                        kv_blocks_total=100, kv_blocks_free=75, qps=2.5, unix_ms=123)
            await asyncio.sleep(request.interval_ms / 1000)

    async def GetInfo(self, request: engine_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
                      ) -> engine_pb2.EngineInfo:
        return engine_pb2.EngineInfo(replica_id=self.replica_id, model=MODEL, model_version=VERSION,
                                     region="local", max_context=512, block_size=4, max_waiting=32)

    async def Abort(self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> engine_pb2.AbortResponse:
        return engine_pb2.AbortResponse(found=False)


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Prompt ids: one per message (or word); the decoder: a WordLevel model over t0..t199."""

    def __init__(self) -> None:
        self.templated: list[list[tuple[str, str]]] = []
        self.json = Tokenizer(WordLevel(VOCAB, unk_token="[UNK]")).to_str()

    async def ApplyChatTemplate(self, request: tokenizer_pb2.ChatTemplateRequest, context: grpc.aio.ServicerContext
                                ) -> tokenizer_pb2.EncodeResponse:
        self.templated.append([(m.role, m.content) for m in request.messages])
        return tokenizer_pb2.EncodeResponse(ids=[1] + [2] * len(request.messages))

    async def Encode(self, request: tokenizer_pb2.EncodeRequest, context: grpc.aio.ServicerContext
                     ) -> tokenizer_pb2.EncodeResponse:
        return tokenizer_pb2.EncodeResponse(ids=[1] + [3] * len(request.text.split()))

    async def GetTokenizerJson(self, request: tokenizer_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
                               ) -> tokenizer_pb2.TokenizerJson:
        return tokenizer_pb2.TokenizerJson(model=request.model, tokenizer_json=self.json)


class FakeCache(cache_pb2_grpc.CacheServicer):
    def __init__(self) -> None:
        self.sessions: dict[str, list[tuple[str, str]]] = {}

    def _context(self, session_id: str) -> cache_pb2.SessionContext:
        messages = self.sessions.get(session_id)
        return cache_pb2.SessionContext(session_id=session_id, found=messages is not None, messages=[
            tokenizer_pb2.ChatMessage(role=role, content=content) for role, content in messages or []])

    async def GetSession(self, request: cache_pb2.SessionRequest, context: grpc.aio.ServicerContext
                         ) -> cache_pb2.SessionContext:
        return self._context(request.session_id)

    async def AppendSession(self, request: cache_pb2.AppendSessionRequest, context: grpc.aio.ServicerContext
                            ) -> cache_pb2.SessionContext:
        self.sessions.setdefault(request.session_id, []).extend((m.role, m.content) for m in request.messages)
        return self._context(request.session_id)


# -- the mesh in one process ----------------------------------------------------------------
@dataclass
class Mesh:
    router: router_pb2_grpc.RouterStub
    router_address: str
    servicer: RouterServicer
    script: Script
    tokenizer: FakeTokenizer
    cache: FakeCache


async def _serve(name: str, add: Callable[[grpc.aio.Server], None]) -> Service:
    service = Service(name, "127.0.0.1", 0)
    add(service.server)
    await service.start()
    await service.ready()
    return service


@contextlib.asynccontextmanager
async def running(engines: int = 2, waiting: int = 0, script: Script | None = None,
                  cache: bool = True, engine: type[FakeEngine] = FakeEngine,
                  weights: tuple[float, ...] = (), **config_fields: Any) -> AsyncIterator[Mesh]:
    """The router over fake engines; weights: engine i's discovery weight (default 1); config_fields:
    RouterConfig fields beyond the defaults here."""
    script = script or Script()
    tokenizer, store = FakeTokenizer(), FakeCache()
    services = [await _serve("meshpb.v1.Tokenizer",
                             lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(tokenizer, s))]
    if cache:
        services.append(await _serve("meshpb.v1.Cache", lambda s: cache_pb2_grpc.add_CacheServicer_to_server(store, s)))
    endpoints = []
    for i in range(engines):
        fake = engine(f"engine-{i}", script, waiting)
        services.append(await _serve("meshpb.v1.Engine",
                                     lambda s, e=fake: engine_pb2_grpc.add_EngineServicer_to_server(e, s)))
        endpoints.append(Endpoint("engine", f"engine-{i}", f"127.0.0.1:{services[-1].port}",
                                  weight=weights[i] if i < len(weights) else 1.0))
    config = RouterConfig(tokenizer=f"127.0.0.1:{services[0].port}", engines=tuple(endpoints),
                          cache=f"127.0.0.1:{services[1].port}" if cache else "", default_model=MODEL,
                          probe_interval_s=0.1, load_interval_ms=50, first_token_timeout_s=5.0, stall_timeout_s=5.0,
                          **config_fields)
    router = Service("meshpb.v1.Router", "127.0.0.1", 0)
    servicer = RouterServicer(config)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, router.server)
    await router.start()
    await servicer.start(report_ready=router.ready)
    address = f"127.0.0.1:{router.port}"
    try:
        await _until(lambda: servicer.ready() and all(r.healthy and r.model and r.kv_blocks_total
                                                      for r in servicer.table.all()), "replicas ready")
        await _until(lambda: check_health(address), "router SERVING")
        async with channel(address) as ch:
            yield Mesh(router_pb2_grpc.RouterStub(ch), address, servicer, script, tokenizer, store)
    finally:
        await servicer.close()
        await router.stop(0)
        for service in services:
            await service.stop(0)


async def _until(ready: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        answer = ready()
        if answer if isinstance(answer, bool) else await answer:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def chat(*messages: tuple[str, str], max_tokens: int = 8, session: str = "",
         tenant: str = "") -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        model=MODEL, chat=router_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role=r, content=c)
                                                         for r, c in messages]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, seed=7), session_id=session,
        include_token_ids=True, tenant=tenant)


async def collect(mesh: Mesh, request: router_pb2.RouterGenerateRequest) -> list[router_pb2.RouterGenerateResponse]:
    return [reply async for reply in mesh.router.Generate(request, timeout=20)]


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


def ids_of(replies: list[router_pb2.RouterGenerateResponse]) -> list[int]:
    return [i for reply in replies for i in reply.ids]


# -- tests -------------------------------------------------------------------------------
def test_streams_text_deltas_with_usage_and_the_replica() -> None:
    async def scenario() -> None:
        async with running() as mesh:
            replies = await collect(mesh, chat(("user", "hi"), max_tokens=6))
            expected = [FIRST + p for p in range(6)]
            assert ids_of(replies) == expected
            assert "".join(r.text for r in replies) == words(expected)
            assert len(replies) == 6 and replies[-1].finish_reason == LENGTH
            assert replies[-1].usage.prompt_tokens == 2 and replies[-1].usage.completion_tokens == 6
            served = replies[-1].served_by
            assert (served.model, served.model_version, served.degraded, served.confidence) == (MODEL, VERSION,
                                                                                                False, 1.0)
            assert replies[0].served_by.replica == served.replica
            [(replica, request)] = mesh.script.calls
            assert replica == served.replica and list(request.prompt_ids) == [1, 2] and not request.resume_ids

    run(scenario)


def test_failover_before_the_first_token_goes_to_another_replica() -> None:
    async def scenario() -> None:
        script = Script([Behaviour(fail_after=0, code=grpc.StatusCode.UNAVAILABLE)])
        async with running(script=script) as mesh:
            replies = await collect(mesh, chat(("user", "hi"), max_tokens=5))
            assert ids_of(replies) == [FIRST + p for p in range(5)]
            (first, _), (second, request) = mesh.script.calls
            assert first != second and replies[-1].served_by.replica == second
            assert not request.resume_ids
            # Level 1: the replica that answered UNAVAILABLE is isolated until a later probe passes.
            assert mesh.servicer.failover.isolation(first) is not None
            await _until(lambda: mesh.servicer.failover.isolation(first) is None, "re-admitted by a probe")

    run(scenario)


def test_mid_stream_resume_continues_from_the_tokens_sent() -> None:
    async def scenario() -> None:
        script = Script([Behaviour(fail_after=3, code=grpc.StatusCode.UNAVAILABLE)])
        async with running(script=script) as mesh:
            replies = await collect(mesh, chat(("user", "hi"), max_tokens=8))
            expected = [FIRST + p for p in range(8)]
            assert ids_of(replies) == expected                 # nothing lost, nothing repeated
            assert "".join(r.text for r in replies) == words(expected)
            assert [r.finish_reason for r in replies].count(LENGTH) == 1 and replies[-1].finish_reason == LENGTH
            (first, _), (second, resumed) = mesh.script.calls
            assert first != second and replies[-1].served_by.replica == second
            assert list(resumed.resume_ids) == expected[:3]
            assert list(resumed.prompt_ids) == [1, 2] and resumed.sampling.seed == 7

    run(scenario)


def test_an_engine_dying_after_the_last_token_ends_the_stream_there() -> None:
    async def scenario() -> None:
        script = Script([Behaviour(fail_after=4, final=False)])
        async with running(script=script) as mesh:
            replies = await collect(mesh, chat(("user", "hi"), max_tokens=4))
            assert ids_of(replies) == [FIRST + p for p in range(4)]
            assert replies[-1].finish_reason == LENGTH and replies[-1].usage.completion_tokens == 4
            assert len(mesh.script.calls) == 1

    run(scenario)


def test_attempts_are_bounded_when_every_replica_fails() -> None:
    async def scenario() -> None:
        script = Script([Behaviour(fail_after=0, code=grpc.StatusCode.INTERNAL) for _ in range(10)])
        async with running(engines=4, script=script) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(mesh, chat(("user", "hi")))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no attempt or retry budget left for this request" in (err.value.details() or "")
            tried = [replica for replica, _ in mesh.script.calls]
            assert len(tried) == mesh.servicer.config.max_attempts == 3 and len(set(tried)) == 3

    run(scenario)


def test_no_retry_once_the_shared_retry_budget_is_spent() -> None:
    async def scenario() -> None:
        script = Script([Behaviour(fail_after=0, code=grpc.StatusCode.INTERNAL)])
        async with running(script=script) as mesh:
            budget = mesh.servicer.failover.budget
            while budget.try_spend(time.monotonic()):
                pass                                           # other requests' retries took the budget
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(mesh, chat(("user", "hi")))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no attempt or retry budget left" in (err.value.details() or "")
            assert len(mesh.script.calls) == 1                 # the healthy second replica was not tried

    run(scenario)


def test_sessions_merge_the_stored_history_and_store_the_turn() -> None:
    async def scenario() -> None:
        async with running() as mesh:
            # The store's key: the tenant ("grpc:" for a request that names none, as here) and the id.
            mesh.cache.sessions["grpc:/s1"] = [("system", "be brief"), ("user", "hello"), ("assistant", "hi")]
            replies = await collect(mesh, chat(("system", "be brief"), ("user", "again"), max_tokens=3, session="s1"))
            answer = "".join(r.text for r in replies)
            assert answer == words([FIRST, FIRST + 1, FIRST + 2])
            assert mesh.tokenizer.templated == [[("system", "be brief"), ("user", "hello"), ("assistant", "hi"),
                                                 ("user", "again")]]
            assert list(mesh.script.calls[0][1].prompt_ids) == [1, 2, 2, 2, 2]
            assert mesh.cache.sessions["grpc:/s1"][3:] == [("user", "again"), ("assistant", answer)]
            # A prompt (not chat) request neither reads nor writes the session.
            prompt = router_pb2.RouterGenerateRequest(model=MODEL, prompt="a b", session_id="s1",
                                                      sampling=common_pb2.SamplingParams(max_tokens=2))
            await collect(mesh, prompt)
            assert len(mesh.cache.sessions["grpc:/s1"]) == 5 and list(mesh.script.calls[1][1].prompt_ids) == [1, 3, 3]

    run(scenario)


def test_saturated_replicas_shed_with_unavailable_and_retry_after() -> None:
    async def scenario() -> None:
        async with running(waiting=40) as mesh:             # over the engines' own bound (max_waiting 32)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(mesh, chat(("user", "hi")))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "2 saturated" in (err.value.details() or "")
            assert ("retry-after", "1") in tuple(err.value.trailing_metadata() or ())
            assert mesh.script.calls == []

    run(scenario)


def test_a_request_whose_deadline_the_queues_would_outlast_is_refused_at_once() -> None:
    """20 queued at 2.5 requests/s: ~8 s of queue.  A call with 3 s left is refused now (UNAVAILABLE,
    retry-after when the queue will have drained enough) instead of waiting to time out; with 20 s it runs."""
    async def scenario() -> None:
        async with running(waiting=20) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in mesh.router.Generate(chat(("user", "hi")), timeout=3):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "2 late" in (err.value.details() or "") and "deadline" in (err.value.details() or "")
            # 8 s of queue less what is left of the 3 s when the router plans (tokenizing took some)
            assert dict(err.value.trailing_metadata() or ())["retry-after"] in ("5", "6")
            assert mesh.script.calls == []
            assert ids_of(await collect(mesh, chat(("user", "hi")))) != []      # timeout=20: room to wait

    run(scenario)


def test_engines_out_of_resources_end_in_unavailable_with_retry_after() -> None:
    async def scenario() -> None:
        script = Script([Behaviour(fail_after=0, code=grpc.StatusCode.RESOURCE_EXHAUSTED) for _ in range(2)])
        async with running(script=script) as mesh:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(mesh, chat(("user", "hi")))
            # Each replica is retried once, then none is left: shed like saturation (the edge's 503).
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "2 excluded" in (err.value.details() or "")
            assert ("retry-after", "1") in tuple(err.value.trailing_metadata() or ())
            assert len(mesh.script.calls) == 2

    run(scenario)


def test_admin_rpcs_report_models_replicas_and_routing() -> None:
    async def scenario() -> None:
        async with running(cache=False) as mesh:
            models = await mesh.router.ListModels(router_pb2.ListModelsRequest())
            [entry] = models.models
            assert (entry.name, entry.version, entry.replicas, entry.max_context, list(entry.versions)) == (
                MODEL, VERSION, 2, 512, [VERSION])
            replicas = await mesh.router.ListReplicas(router_pb2.ListReplicasRequest())
            assert [r.replica_id for r in replicas.replicas] == ["engine-0", "engine-1"]
            for r in replicas.replicas:
                assert r.healthy and r.breaker == "closed" and r.isolation == "" and r.load.replica_id == r.replica_id
                assert (r.load.running, r.load.kv_blocks_total, r.load.kv_blocks_free, r.load.unix_ms) == (
                    1, 100, 75, 123)
                assert r.load.qps == pytest.approx(2.5)
            routing = await mesh.router.SetModelRouting(router_pb2.SetModelRoutingRequest(
                model=MODEL, canary={VERSION: 0.25}, replace_canary=True))
            assert (routing.default_version, dict(routing.canary)) == (VERSION, {VERSION: 0.25})
            assert await mesh.router.GetModelRouting(router_pb2.ModelRoutingRequest(model="")) == routing
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await mesh.router.GetModelRouting(router_pb2.ModelRoutingRequest(model="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            # No session store configured: a session request still streams.
            replies = await collect(mesh, chat(("user", "hi"), max_tokens=2, session="s9"))
            assert ids_of(replies) == [FIRST, FIRST + 1]

    run(scenario)



def test_not_ready_until_every_expected_engine_is_healthy() -> None:
    """Issue 20: with two engines configured and one still starting, the router is not ready (the edge's
    /health says 503), so the first requests cannot all pile onto the one that is up; once both have
    been healthy, one engine going away leaves it ready."""
    import socket

    async def scenario() -> None:
        tokenizer = FakeTokenizer()
        services = [await _serve("meshpb.v1.Tokenizer",
                                 lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(tokenizer, s))]
        first = FakeEngine("engine-0", Script())
        services.append(await _serve("meshpb.v1.Engine",
                                     lambda s: engine_pb2_grpc.add_EngineServicer_to_server(first, s)))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            late_port = sock.getsockname()[1]
        config = RouterConfig(tokenizer=f"127.0.0.1:{services[0].port}", default_model=MODEL, probe_interval_s=0.1,
                              load_interval_ms=50, engines=(
                                  Endpoint("engine", "engine-0", f"127.0.0.1:{services[1].port}"),
                                  Endpoint("engine", "engine-1", f"127.0.0.1:{late_port}")))
        servicer = RouterServicer(config)
        await servicer.start()
        late = Service("meshpb.v1.Engine", "127.0.0.1", late_port)
        try:
            def healthy(rid: str) -> bool:
                replica = servicer.table.get(rid)
                return replica is not None and replica.healthy

            await _until(lambda: servicer.watch.tokenizer_healthy and healthy("engine-0"), "engine-0 healthy")
            await asyncio.sleep(0.5)                       # several probe rounds: engine-1 is still not up
            assert not servicer.ready() and config.expected_engines == 2
            engine_pb2_grpc.add_EngineServicer_to_server(FakeEngine("engine-1", Script()), late.server)
            await late.start()
            await _until(servicer.ready, "ready once both engines are healthy")
            await late.stop(0)
            await _until(lambda: not healthy("engine-1"), "engine-1 gone")
            assert servicer.ready()                        # one engine serving is enough from now on
        finally:
            await servicer.close()
            for service in services:
                await service.stop(0)

    run(scenario)
