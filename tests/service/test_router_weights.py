"""Replica weights through the real router (the fake engines of tests/fakes/router_mesh.py) and through Consul
(its double)."""

from __future__ import annotations

import asyncio
from collections import Counter

from mesh.discovery import Endpoint, HealthCheck
from services.router.replicas import ReplicaTable
from tests.fakes.router_mesh import Mesh, chat, collect, run, running
from tests.service.test_consul import FAST, _double, _engines, _Follower
from tests.service.test_consul import _discovery as consul_discovery


async def served_by(mesh: Mesh, n: int) -> Counter[str]:
    """n requests one after another: which replica answered each."""
    counts: Counter[str] = Counter()
    for i in range(n):
        counts[(await collect(mesh, chat(("user", f"question {i}"), max_tokens=2)))[-1].served_by.replica] += 1
    return counts


def test_a_replica_of_weight_3_answers_three_times_the_requests_of_one_of_weight_1() -> None:
    async def scenario() -> None:
        async with running(weights=(3, 1)) as mesh:                  # the default policy, balancing+...
            assert [(r.replica_id, r.weight) for r in mesh.servicer.table.all()] == [("engine-0", 3.0),
                                                                                     ("engine-1", 1.0)]
            assert await served_by(mesh, 40) == {"engine-0": 30, "engine-1": 10}

    run(scenario)


def test_round_robin_is_smooth_weighted() -> None:
    async def scenario() -> None:
        async with running(engines=3, weights=(2, 1, 1), policy="round_robin") as mesh:
            order = [(await collect(mesh, chat(("user", f"q{i}"), max_tokens=1)))[-1].served_by.replica
                     for i in range(8)]
            assert order == ["engine-0", "engine-1", "engine-2", "engine-0"] * 2

    run(scenario)


def test_a_standby_of_weight_0_answers_only_when_nothing_else_can() -> None:
    async def scenario() -> None:
        async with running(weights=(0, 1)) as mesh:
            assert await served_by(mesh, 6) == {"engine-1": 6}
            active = mesh.servicer.table.get("engine-1")
            assert active is not None
            active.draining = True                                     # no new requests to it
            assert await served_by(mesh, 3) == {"engine-0": 3}

    run(scenario)


def test_a_weight_in_consul_meta_reaches_the_replica_table() -> None:
    async def scenario() -> None:
        with _double() as double:
            discovery = consul_discovery(double)
            async with _engines(2) as (a, b):
                for i, (svc, weight) in enumerate(((a, 3.0), (b, 1.0))):
                    endpoint = Endpoint("engine", f"engine-{i}", f"127.0.0.1:{svc.port}", weight=weight)
                    await discovery.register(endpoint, HealthCheck.grpc(endpoint.address, **FAST))
                follower = _Follower(discovery, "engine")
                try:
                    seen = await follower.until(lambda eps: len(eps) == 2)
                    assert [(e.replica_id, e.weight, e.meta) for e in seen] == [("engine-0", 3.0, ()),
                                                                               ("engine-1", 1.0, ())]
                    table = ReplicaTable()
                    table.sync(seen)
                    assert [r.weight for r in table.all()] == [3.0, 1.0]
                finally:
                    await follower.stop()
                    for i in range(2):
                        await discovery.deregister(f"engine-{i}")
                    await discovery.close()

    asyncio.run(scenario())
