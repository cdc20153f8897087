"""The launcher's supervision (infermesh/supervise.py): a dead child is started again after a backoff that
doubles while it keeps dying, counted by kind; with restart off it is only reported."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from infermesh import supervise


@dataclass
class Proc:
    returncode: int | None = None


@dataclass
class Child:
    name: str
    proc: Proc | None = None


def restarts(kind: str) -> float:
    return supervise.RESTARTS.labels(kind)._value.get()


def test_a_dead_child_is_restarted_with_doubling_backoff_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervise, "FIRST_DELAY_S", 0.1)
    monkeypatch.setattr(supervise, "MAX_DELAY_S", 0.4)
    engine, router = Child("engine-1", Proc()), Child("router-0", Proc())
    starts: list[tuple[str, float]] = []
    lines: list[str] = []
    before = restarts("engine")

    async def start(child: Child) -> None:
        starts.append((child.name, asyncio.get_running_loop().time()))
        child.proc = Proc()

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(supervise.supervise([engine, router], stop, start, log=lines.append, poll_s=0.01))
        t0 = asyncio.get_running_loop().time()
        for _ in range(4):                  # it dies again as soon as it is back
            assert engine.proc is not None
            engine.proc.returncode = -9
            n = len(starts)
            while len(starts) == n:
                await asyncio.sleep(0.01)
        stop.set()
        await task
        gaps = [round(t - prev, 1) for (_, prev), (_, t) in zip([("", t0), *starts], starts, strict=False)]
        assert [n for n, _ in starts] == ["engine-1"] * 4 and router.proc is not None and router.proc.returncode is None
        assert gaps[0] >= 0.1 and gaps[1] >= 0.2 and gaps[2] >= 0.4 and gaps[3] >= 0.4, gaps   # capped at 0.4

    asyncio.run(scenario())
    assert restarts("engine") - before == 4
    assert "infermesh: engine-1 exited with code -9; restarting it in 0.1 s" in lines
    assert "infermesh: engine-1 restarted (restart 4)" in lines


def test_without_restart_a_death_is_reported_once() -> None:
    child = Child("tokenizer-0", Proc(returncode=1))
    lines: list[str] = []

    async def start(c: Child) -> None:
        raise AssertionError("no restart wanted")

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(supervise.supervise([child], stop, start, restart=False, log=lines.append,
                                                       poll_s=0.01))
        await asyncio.sleep(0.1)
        stop.set()
        await task

    asyncio.run(scenario())
    assert lines == ["infermesh: tokenizer-0 exited with code 1"]
    assert supervise.kind("fallback-0") == "engine" and supervise.kind("edge-0") == "edge"
