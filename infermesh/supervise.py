"""The launcher's supervision: a child that dies is restarted, with backoff, the way a supervisor or the
kubelet would (`infermesh up --no-restart` only reports it: for tests that kill on purpose).

A child is started again with the same command line, so on the same ports: the router finds a
restarted engine or tokenizer again by its health probes, the edge its router.  The delay before a
restart doubles from 1 s to 30 s while the child keeps dying soon after it starts; a child that
stayed up a minute starts again from 1 s.  Each restart is logged and counted in
`infermesh_launcher_restarts_total{service}` (the launcher's /metrics, 127.0.0.1:9183 + offset).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from prometheus_client import Counter

RESTARTS = Counter("infermesh_launcher_restarts_total", "Children the launcher restarted after they died",
                   ["service"])

FIRST_DELAY_S, MAX_DELAY_S, STABLE_S = 1.0, 30.0, 60.0


class Process(Protocol):
    @property
    def returncode(self) -> int | None: ...


class Supervised(Protocol):
    name: str

    @property
    def proc(self) -> Process | None: ...


C = TypeVar("C", bound=Supervised)


@dataclass
class _Track:
    started: float
    delay: float
    restarts: int = 0


def kind(name: str) -> str:
    """A child's service kind for the metric: engine-0 -> engine, fallback-1 -> engine, router-0 -> router."""
    base = name.rsplit("-", 1)[0]
    return "engine" if base == "fallback" else base


async def supervise(children: Sequence[C], stop: asyncio.Event, start: Callable[[C], Awaitable[None]],
                    restart: bool = True, log: Callable[[str], None] = print, poll_s: float = 0.5) -> None:
    """Until `stop`: report each child that dies and, with `restart`, start it again after its backoff."""
    now = time.monotonic()
    tracks = {c.name: _Track(now, FIRST_DELAY_S) for c in children}
    due: dict[str, float] = {}              # child name -> when it is restarted
    reported: set[str] = set()
    while not stop.is_set():
        now = time.monotonic()
        for child in children:
            proc, track = child.proc, tracks[child.name]
            if proc is None or proc.returncode is None or child.name in due:
                continue
            if not restart:
                if child.name not in reported:
                    reported.add(child.name)
                    log(f"infermesh: {child.name} exited with code {proc.returncode}")
                continue
            if now - track.started >= STABLE_S:
                track.delay = FIRST_DELAY_S
            due[child.name] = now + track.delay
            log(f"infermesh: {child.name} exited with code {proc.returncode}; restarting it in {track.delay:g} s")
        for child in children:
            if child.name in due and due[child.name] <= now and not stop.is_set():
                del due[child.name]
                track = tracks[child.name]
                track.restarts += 1
                track.started = time.monotonic()
                track.delay = min(MAX_DELAY_S, track.delay * 2)   # if it dies again soon
                RESTARTS.labels(kind(child.name)).inc()
                await start(child)
                log(f"infermesh: {child.name} restarted (restart {track.restarts})")
        try:
            await asyncio.wait_for(stop.wait(), poll_s)
        except TimeoutError:
            pass
