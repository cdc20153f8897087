"""Issue 20: no single router or tokenizer.  Routers in-process against the fake engines, tokenizer
and cache of tests/fakes/router_mesh.py: a stream resumed on another router from the token ids already sent
(`resume_ids`), the edge's RouterPool moving a stream whose router died, and a router balancing
over tokenizer replicas."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator

import grpc
import pytest

from mesh.clients.router_client import GenerateSpec, Message, Sampling
from mesh.clients.router_pool import RouterPool, router_failed
from mesh.grpcutil import Service, answered
from meshpb.v1 import engine_pb2, router_pb2_grpc
from services.router.server import RouterServicer
from services.router.wire import request_from_pb
from tests.fakes.router_mesh import (
    FIRST,
    LENGTH,
    MODEL,
    Behaviour,
    FakeEngine,
    Script,
    chat,
    collect,
    ids_of,
    run,
    running,
    until,
    words,
)


@contextlib.asynccontextmanager
async def second_router(servicer: RouterServicer) -> AsyncIterator[tuple[Service, RouterServicer]]:
    """Another router over the same engines, tokenizer and cache."""
    other = RouterServicer(servicer.config)
    service = Service("meshpb.v1.Router", "127.0.0.1", 0)
    router_pb2_grpc.add_RouterServicer_to_server(other, service.server)
    await service.start()
    await other.start(report_ready=service.ready)
    try:
        await until(other.ready, "second router ready")
        yield service, other
    finally:
        await other.close()
        await service.stop(0)


def spec(max_tokens: int) -> GenerateSpec:
    return GenerateSpec(model=MODEL, sampling=Sampling(max_tokens=max_tokens, seed=7),
                        messages=(Message("user", "hi"),), request_id="r-1")


def test_a_router_resumes_a_stream_from_the_ids_another_router_sent() -> None:
    async def scenario() -> None:
        async with running() as mesh:
            expected = [FIRST + p for p in range(8)]
            request = chat(("user", "hi"), max_tokens=8)
            request.resume_ids.extend(expected[:3])
            replies = await collect(mesh, request)
            assert ids_of(replies) == expected[3:]                     # only what comes after
            assert words(expected[:3]) + "".join(r.text for r in replies) == words(expected)
            assert replies[-1].finish_reason == LENGTH and replies[-1].usage.completion_tokens == 8
            [(_, engine_request)] = mesh.script.calls
            assert list(engine_request.resume_ids) == expected[:3]

    run(scenario)


def test_the_pool_resumes_a_stream_on_another_router_when_its_router_dies() -> None:
    async def scenario() -> None:
        async with running() as mesh, second_router(mesh.servicer) as (other, _):
            moved: list[str] = []
            pool = RouterPool([mesh.router_address, f"127.0.0.1:{other.port}"], on_failover=moved.append)
            pool.start()
            try:
                got = []
                stream = pool.generate(spec(40), timeout=30)
                async for delta in stream:
                    got.append(delta)
                    if len(got) == 5:                            # kill the router carrying it, mid-stream
                        [carrying] = [r for r in pool._routers.values() if r.in_flight]
                        await _SERVERS[carrying.client.address].stop(0)
                expected = [FIRST + p for p in range(40)]
                assert [i for d in got for i in d.ids] == expected          # none lost, none repeated
                assert "".join(d.text for d in got) == words(expected)
                assert got[-1].finish_reason == "length" and got[-1].completion_tokens == 40
                assert len(moved) == 1
            finally:
                await pool.close()

    run(scenario)


_SERVERS: dict[str, Service] = {}


@pytest.fixture(autouse=True)
def _track_router_services(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remember each Service by address, so a test can stop one that router_mesh.running made."""
    original = Service.start

    async def start(self: Service) -> None:
        await original(self)
        _SERVERS[f"127.0.0.1:{self.port}"] = self

    monkeypatch.setattr(Service, "start", start)


def test_the_pool_does_not_retry_what_a_router_answered() -> None:
    async def scenario() -> None:
        async with running() as mesh, second_router(mesh.servicer) as (other, _):
            moved: list[str] = []
            pool = RouterPool([mesh.router_address, f"127.0.0.1:{other.port}"], on_failover=moved.append)
            try:
                bad = dataclasses.replace(spec(4), model="no-such-model")
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for _ in pool.generate(bad, timeout=10):
                        pass
                assert answered(caught.value) and not router_failed(caught.value) and not moved
                assert caught.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
            finally:
                await pool.close()

    run(scenario)


def _dead_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_a_router_balances_over_tokenizer_replicas_and_skips_a_dead_one() -> None:
    async def scenario() -> None:
        async with running() as mesh:
            both = f"{_dead_address()},{mesh.servicer.config.tokenizer}"
            config = dataclasses.replace(mesh.servicer.config, tokenizer=both)
            router = RouterServicer(config)
            service = Service("meshpb.v1.Router", "127.0.0.1", 0)
            router_pb2_grpc.add_RouterServicer_to_server(router, service.server)
            await service.start()
            await router.start(report_ready=service.ready)
            try:
                await until(router.ready, "ready with one tokenizer replica of two up")
                async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as ch:
                    stub = router_pb2_grpc.RouterStub(ch)
                    for _ in range(6):                 # every call, whichever replica its turn starts at
                        replies = [r async for r in stub.Generate(chat(("user", "hi"), max_tokens=3), timeout=20)]
                        assert ids_of(replies) == [FIRST, FIRST + 1, FIRST + 2]
                    # The probes found the dead replica: calls try the live one first.
                    assert router.tokenizer.healthy == [False, True]
                    router.watch.on_tokenizers = lambda healthy: None
                    router.tokenizer.healthy = [True, True]      # as before the first probe: the dead one gets turns
                    for _ in range(4):
                        replies = [r async for r in stub.Generate(chat(("user", "hi"), max_tokens=3), timeout=20)]
                        assert ids_of(replies) == [FIRST, FIRST + 1, FIRST + 2]
                    dead = router.tokenizer.breakers[0]
                    assert dead.failure_count >= 1 or dead.state != "closed"
                    # Every replica down: UNAVAILABLE at once, naming each, with a retry hint.
                    only_dead = RouterServicer(dataclasses.replace(config, tokenizer=_dead_address()))
                    with pytest.raises(Exception) as caught:
                        await only_dead.tokenizer.tokenize(request_from_pb(chat(("user", "hi"))), MODEL,
                                                          [Message("user", "hi")])
                    assert "every tokenizer replica is failing" in str(caught.value)
                    assert getattr(caught.value, "code", None) == grpc.StatusCode.UNAVAILABLE
            finally:
                await router.close()
                await service.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_stream_waiting_on_a_router_that_stops_answering_probes_moves_on() -> None:
    """A hung router (SIGSTOP) never closes its connection; its probes failing is what moves the stream."""
    async def scenario() -> None:
        async with running(script=Script([Behaviour(stall_after=5)])) as mesh, \
                second_router(mesh.servicer) as (other, _):
            moved: list[str] = []
            pool = RouterPool([mesh.router_address, f"127.0.0.1:{other.port}"], on_failover=moved.append)
            got = []
            async for delta in pool.generate(spec(60), timeout=30):   # no probe task: the test plays it
                got.append(delta)
                if len(got) == 5:                        # its engine, and so the router, goes silent now
                    [carrying] = [r for r in pool._routers.values() if r.in_flight]
                    carrying.misses = 2                  # as two missed probes of a hung router would
            expected = [FIRST + p for p in range(60)]
            assert [i for d in got for i in d.ids] == expected and "".join(d.text for d in got) == words(expected)
            assert len(moved) == 1
            await pool.close()

    run(scenario)


def test_a_session_turn_is_refused_not_answered_without_its_history_when_the_store_is_down() -> None:
    async def scenario() -> None:
        async with running() as mesh:
            turn = chat(("user", "hi"), max_tokens=3, session="s-1")
            assert ids_of(await collect(mesh, turn)) == [FIRST, FIRST + 1, FIRST + 2]
            assert len(mesh.cache.sessions) == 1
            await _SERVERS[mesh.servicer.config.cache].stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(mesh, chat(("user", "again"), max_tokens=3, session="s-1"))
            err = caught.value
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "session store" in (err.details() or "")
            assert "retry in" in (err.details() or "") and dict(err.trailing_metadata() or ())["retry-after"]
            # Requests without a session never touch the store.
            assert ids_of(await collect(mesh, chat(("user", "hi"), max_tokens=2))) == [FIRST, FIRST + 1]

    run(scenario)


class TwoVersions(FakeEngine):
    """engine-0 serves version 1; engine-1 version 2, whose tokens differ from the fourth on."""

    async def GetInfo(self, request: engine_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
                      ) -> engine_pb2.EngineInfo:
        info = await super().GetInfo(request, context)
        info.model_version = "2" if self.replica_id == "engine-1" else "1"
        return info

    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        async for reply in super().Generate(request, context):
            if self.replica_id == "engine-1" and reply.ids and reply.ids[0] >= FIRST + 3:
                reply.ids[0] += 50
            yield reply


def test_shadow_traffic_mirrors_compares_and_never_serves_the_shadow() -> None:
    """Issue 21: every unpinned request mirrored to version 2; the client gets version 1's answer,
    the comparison counts each mirror as diverged (at the fourth token) in the admin API and the metric."""
    async def scenario() -> None:
        async with running(engine=TwoVersions) as mesh:
            await until(lambda: {r.model_version for r in mesh.servicer.table.all()} == {"1", "2"}, "versions")
            mesh.servicer.admin.set_routing(MODEL, "1", None, ("2", 1.0))
            for i in range(4):
                replies = await collect(mesh, chat(("user", f"hi {i}"), max_tokens=6, session=f"s-{i}"))
                assert ids_of(replies) == [FIRST + p for p in range(6)]       # version 1's, never the shadow's
                assert replies[-1].served_by.replica == "engine-0" and replies[-1].served_by.model_version == "1"
            shadows = mesh.servicer.dispatcher.shadows
            await until(lambda: shadows.of(MODEL, "2").diverged == 4, "four mirrors compared")
            stats = mesh.servicer.admin.routing(MODEL).shadow_stats
            assert stats is not None and stats["mirrored"] == 4 and stats["matched"] == 0 and stats["failed"] == 0
            # "t100 t101 t102 t103" against "t100 t101 t102 t153": they part at the "0" of "t103".
            assert stats["mean_first_divergence"] == len(words([FIRST, FIRST + 1, FIRST + 2])) + len(" t1")
            mirrored = [r for replica, r in mesh.script.calls if replica == "engine-1"]
            assert len(mirrored) == 4 and all(r.request_id.endswith("~shadow") for r in mirrored)
            assert all(len(turns) == 2 for turns in mesh.cache.sessions.values())   # the mirror stored nothing
            # Ended: nothing mirrored any more.
            mesh.servicer.admin.set_routing(MODEL, "", None, ("", 0.0))
            await collect(mesh, chat(("user", "bye"), max_tokens=2))
            assert len([1 for replica, _ in mesh.script.calls if replica == "engine-1"]) == 4

    run(scenario)
