"""Level 3 by latency and the measured confidence of degraded answers, through the real router.

engine-0 serves the primary model and can be made slow to its first token; engine-1 serves the
fallback (the fake engines of tests/fakes/router_mesh.py answer the same tokens, so a mirror agrees)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from meshpb.v1 import common_pb2, engine_pb2
from services.router.failover import Evaluation
from tests.fakes.router_mesh import MODEL, FakeEngine, Mesh, chat, collect, run, running, until

FALLBACK = "m-fb"
DELAY = [0.0]                  # seconds engine-0 waits before its first token


class SlowPrimary(FakeEngine):
    async def GetInfo(self, request: engine_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
                      ) -> engine_pb2.EngineInfo:
        info = await super().GetInfo(request, context)
        info.model = FALLBACK if self.replica_id == "engine-1" else MODEL
        return info

    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        if self.replica_id == "engine-0" and DELAY[0]:
            await asyncio.sleep(DELAY[0])
        async for reply in super().Generate(request, context):
            yield reply


async def ask(mesh: Mesh, priority: int = common_pb2.PRIORITY_INTERACTIVE) -> common_pb2.ServedBy:
    request = chat(("user", "hi"), max_tokens=3)
    request.priority = priority                                    # type: ignore[assignment]
    return (await collect(mesh, request))[-1].served_by


def test_slow_first_tokens_send_a_share_of_interactive_requests_to_the_fallback_until_they_recover() -> None:
    async def scenario() -> None:
        DELAY[0] = 0.3
        async with running(engine=SlowPrimary, fallbacks=((MODEL, FALLBACK, 0.8),), latency_degrade_p95_ms=150,
                           latency_degrade_window_s=3.0, latency_degrade_min_samples=4, latency_degrade_after_s=0.3,
                           latency_degrade_share=0.5, fallback_evals=(Evaluation(MODEL, FALLBACK, 0.9, 100),)) as mesh:
            # Nothing is degraded before 4 first tokens were measured over 150 ms for 0.3 s.
            served = [await ask(mesh)]
            while not served[-1].degraded and len(served) < 20:
                served.append(await ask(mesh))
            assert len(served) >= 5 and not any(s.degraded for s in served[:-1])
            first = served[-1]
            assert (first.model, first.replica, first.degraded) == (FALLBACK, "engine-1", True)
            # The confidence is the offline evaluation's 90 of 100 with the configured 0.8 as a prior worth 20.
            assert first.confidence == pytest.approx((20 * 0.8 + 90) / 120, rel=1e-6)
            # Meanwhile every second interactive request (share 0.5) goes to the fallback; no batch request does.
            assert [(await ask(mesh)).model for _ in range(6)] == [MODEL, FALLBACK] * 3
            assert [(await ask(mesh, common_pb2.PRIORITY_BATCH)).model for _ in range(3)] == [MODEL] * 3
            # The primary is fast again: once its slow first tokens left the 3 s window, nothing is degraded.
            DELAY[0] = 0.0
            latency, deadline = mesh.servicer.failover.latency, time.monotonic() + 20
            while latency.state(MODEL, time.monotonic()).degrading:
                assert time.monotonic() < deadline, latency.state(MODEL, time.monotonic())
                await ask(mesh)
            assert [(await ask(mesh)).model for _ in range(4)] == [MODEL] * 4
            assert latency.episodes == 1

    try:
        run(scenario)
    finally:
        DELAY[0] = 0.0


def test_mirrors_to_the_fallback_measure_the_confidence_of_degraded_answers() -> None:
    async def scenario() -> None:
        async with running(engine=SlowPrimary, fallbacks=((MODEL, FALLBACK, 0.8),), fallback_shadow_share=1.0) as mesh:
            for _ in range(3):
                served = await ask(mesh)
                assert (served.model, served.degraded, served.confidence) == (MODEL, False, 1.0)
            shadows = mesh.servicer.dispatcher.shadows
            await until(lambda: shadows.agreement(MODEL, FALLBACK) == (3, 3), "three mirrors compared")
            mirrored = [r for replica, r in mesh.script.calls if replica == "engine-1"]
            assert len(mirrored) == 3 and all(r.request_id.endswith("~fallback") and r.model == FALLBACK
                                              for r in mirrored)
            # The primary drains: level 3 answers from the fallback with the measured, not the configured, 0.8.
            primary = mesh.servicer.table.get("engine-0")
            assert primary is not None
            primary.draining = True
            served = await ask(mesh)
            assert (served.model, served.degraded) == (FALLBACK, True)
            assert served.confidence == pytest.approx((20 * 0.8 + 3) / 23, rel=1e-6)
            # Its own mirror compared with a degraded answer: no evidence either way.
            await until(lambda: shadows.of(MODEL, "fallback:" + FALLBACK).failed == 1, "the mirror discarded")
            assert shadows.agreement(MODEL, FALLBACK) == (3, 3)

    run(scenario)
