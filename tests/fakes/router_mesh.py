"""The router's fakes on loopback: engines, tokenizer and cache, and the router's servicer over them.

Every fake is a real grpc.aio server (with health), so the router runs its real code: discovery,
probes, load reports, the dispatcher's failover loop, the relay and the session store client.
The fake engines continue a fixed sequence by position (token at completion position p is
FIRST + p), so a resumed stream is only right when `resume_ids` carried the tokens already sent.
`running()` starts the router over them; `chat`, `collect`, `ids_of` and `words` build requests and read
the replies; `until` waits for a condition; `serve` starts one more fake service.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
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
    pause_s: float = 3600.0                   # how long it stays silent (the default: for good)


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
            if behaviour.stall_after is not None and sent == behaviour.stall_after:
                await asyncio.sleep(behaviour.pause_s)
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


async def serve(name: str, add: Callable[[grpc.aio.Server], None]) -> Service:
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
    services = [await serve("meshpb.v1.Tokenizer",
                            lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(tokenizer, s))]
    if cache:
        services.append(await serve("meshpb.v1.Cache", lambda s: cache_pb2_grpc.add_CacheServicer_to_server(store, s)))
    endpoints = []
    for i in range(engines):
        fake = engine(f"engine-{i}", script, waiting)
        services.append(await serve("meshpb.v1.Engine",
                                    lambda s, e=fake: engine_pb2_grpc.add_EngineServicer_to_server(e, s)))
        endpoints.append(Endpoint("engine", f"engine-{i}", f"127.0.0.1:{services[-1].port}",
                                  weight=weights[i] if i < len(weights) else 1.0))
    config = RouterConfig(tokenizer=f"127.0.0.1:{services[0].port}", engines=tuple(endpoints),
                          cache=f"127.0.0.1:{services[1].port}" if cache else "", default_model=MODEL,
                          **{"probe_interval_s": 0.1, "load_interval_ms": 50, "first_token_timeout_s": 5.0,
                             "stall_timeout_s": 5.0, **config_fields})
    router = Service("meshpb.v1.Router", "127.0.0.1", 0)
    servicer = RouterServicer(config)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, router.server)
    await router.start()
    await servicer.start(report_ready=router.ready)
    address = f"127.0.0.1:{router.port}"
    try:
        await until(lambda: servicer.ready() and all(r.healthy and r.model and r.kv_blocks_total
                                                     for r in servicer.table.all()), "replicas ready")
        await until(lambda: check_health(address), "router SERVING")
        async with channel(address) as ch:
            yield Mesh(router_pb2_grpc.RouterStub(ch), address, servicer, script, tokenizer, store)
    finally:
        await servicer.close()
        await router.stop(0)
        for service in services:
            await service.stop(0)


async def until(ready: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = 10.0) -> None:
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
