"""The router's servicer in-process, against the fake engines, tokenizer and cache of tests/fakes/router_mesh.py:
streaming, failover before the first token and mid-stream resume, retry budgets, shedding, sessions, the
admin RPCs and readiness."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from mesh.discovery import Endpoint
from mesh.grpcutil import Service
from meshpb.v1 import common_pb2, engine_pb2_grpc, router_pb2, tokenizer_pb2_grpc
from services.router.config import RouterConfig
from services.router.server import RouterServicer
from tests.fakes.router_mesh import (
    FIRST,
    LENGTH,
    MODEL,
    VERSION,
    Behaviour,
    FakeEngine,
    FakeTokenizer,
    Script,
    chat,
    collect,
    ids_of,
    run,
    running,
    serve,
    until,
    words,
)


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
            await until(lambda: mesh.servicer.failover.isolation(first) is None, "re-admitted by a probe")

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
        services = [await serve("meshpb.v1.Tokenizer",
                                lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(tokenizer, s))]
        first = FakeEngine("engine-0", Script())
        services.append(await serve("meshpb.v1.Engine",
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

            await until(lambda: servicer.watch.tokenizer_healthy and healthy("engine-0"), "engine-0 healthy")
            await asyncio.sleep(0.5)                       # several probe rounds: engine-1 is still not up
            assert not servicer.ready() and config.expected_engines == 2
            engine_pb2_grpc.add_EngineServicer_to_server(FakeEngine("engine-1", Script()), late.server)
            await late.start()
            await until(servicer.ready, "ready once both engines are healthy")
            await late.stop(0)
            await until(lambda: not healthy("engine-1"), "engine-1 gone")
            assert servicer.ready()                        # one engine serving is enough from now on
        finally:
            await servicer.close()
            for service in services:
                await service.stop(0)

    run(scenario)
