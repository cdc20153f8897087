"""Prometheus metrics of the cache service (served on --metrics-port).  Requests by status and
their durations are counted for every service by mesh.telemetry.server_span."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge

SESSION_LOOKUPS = Counter("infermesh_cache_session_lookups_total", "Session context lookups, by result (hit, miss)",
                          ["result"])
SESSIONS = Gauge("infermesh_cache_sessions", "Live session contexts held (expired ones drop out on access)")


def watch_sessions(count: Callable[[], int]) -> None:
    """Read at scrape time."""
    SESSIONS.set_function(count)
