"""Shadow traffic: a share of requests mirrored to another version, compared, and thrown away.

The dispatcher (dispatch.py) starts the mirror beside the served call and never waits for it: the
client's stream goes on as if there were no shadow.  The mirror runs the same prompt and sampling on
a replica of the shadow version; once both ended, the texts are compared (exact match, or the first
character where they differ) with each one's latency, counted in
`infermesh_router_shadow_requests_total{model,version,outcome}` and kept for the admin API
(GET /admin/models/{model}/routing: `shadow`).  The mirror takes engine time on the shadow version's
replicas, not the served one's.

A mirror may also go to another model: the model's fallback (--fallback-shadow-share), kept under the
shadow "version" FALLBACK + the fallback's name.  Those comparisons are the run-time evidence of how
often the fallback agrees with its primary (`agreement`), which the confidence of degraded answers
is computed from (failover/agreement.py).  A served answer that was itself degraded (from a fallback)
is not the primary's, and a mirror compared with it counts as failed.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from services.router import metrics

SHADOW_TIMEOUT_S = 600.0
FALLBACK = "fallback:"        # the shadow version of a mirror to the fallback model: FALLBACK + its name


@dataclass
class ShadowStats:
    mirrored: int = 0
    matched: int = 0
    diverged: int = 0
    failed: int = 0
    divergences: deque[int] = field(default_factory=lambda: deque(maxlen=1000))
    served_ms: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    shadow_ms: deque[float] = field(default_factory=lambda: deque(maxlen=1000))

    def as_dict(self) -> dict[str, float]:
        return {"mirrored": self.mirrored, "matched": self.matched, "diverged": self.diverged, "failed": self.failed,
                "mean_first_divergence": statistics.fmean(self.divergences) if self.divergences else 0.0,
                "served_p50_ms": statistics.median(self.served_ms) if self.served_ms else 0.0,
                "shadow_p50_ms": statistics.median(self.shadow_ms) if self.shadow_ms else 0.0}


class Shadows:
    """The comparisons per (model, shadow version), and the mirrors in flight."""

    def __init__(self) -> None:
        self.stats: dict[tuple[str, str], ShadowStats] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def of(self, model: str, version: str) -> ShadowStats:
        return self.stats.setdefault((model, version), ShadowStats())

    def agreement(self, primary: str, fallback: str) -> tuple[int, int]:
        """(matched, compared) of the mirrors of `primary`'s requests to the `fallback` model, so far in
        this router's life: the shadow evidence of failover/agreement.py (failed mirrors compare nothing)."""
        stats = self.stats.get((primary, FALLBACK + fallback))
        return (0, 0) if stats is None else (stats.matched, stats.matched + stats.diverged)

    def start(self, model: str, version: str, run: Callable[[], AsyncIterator[Any]]
              ) -> asyncio.Future[tuple[str, float] | None]:
        """Mirror one request: `run()` is the shadow call (its replies' text is collected).  Returns the
        future the served call resolves with (its text, its latency in seconds), or with None when it
        failed; the comparison happens once both are known."""
        served: asyncio.Future[tuple[str, float] | None] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._mirror(model, version, run, served))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return served

    async def _mirror(self, model: str, version: str, run: Callable[[], AsyncIterator[Any]],
                      served: asyncio.Future[tuple[str, float] | None]) -> None:
        stats = self.of(model, version)
        stats.mirrored += 1
        started, text = time.monotonic(), []
        try:
            async with asyncio.timeout(SHADOW_TIMEOUT_S):
                async for reply in run():
                    text.append(reply.text)
            shadow_s = time.monotonic() - started
            async with asyncio.timeout(SHADOW_TIMEOUT_S):
                primary = await served
        except Exception:                       # the shadow failed, or took too long: nothing to compare
            primary, shadow_s = None, 0.0
        if primary is None:
            stats.failed += 1
            metrics.SHADOW.labels(model, version, "failed").inc()
            return
        answer, shadowed = primary[0], "".join(text)
        stats.served_ms.append(primary[1] * 1000)
        stats.shadow_ms.append(shadow_s * 1000)
        if shadowed == answer:
            stats.matched += 1
            metrics.SHADOW.labels(model, version, "matched").inc()
            return
        stats.diverged += 1
        stats.divergences.append(next((i for i, (a, b) in enumerate(zip(answer, shadowed, strict=False)) if a != b),
                                      min(len(answer), len(shadowed))))
        metrics.SHADOW.labels(model, version, "diverged").inc()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Deadline:
    """What the mirror's attempts read of a call context: the time left (the served call's own)."""

    def __init__(self, seconds: float | None):
        self._end = None if seconds is None else time.monotonic() + seconds

    def time_remaining(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())
