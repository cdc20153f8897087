"""The engine's shared-cache counters: read from RemoteCache.stats and the Outbox when scraped."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest

from services.engine import metrics
from services.engine.rpcs.remote_cache import RemoteStats
from services.engine.runtime.kv_transfer import Outbox


class Remote:
    def __init__(self) -> None:
        self.stats = RemoteStats()


def scrape() -> dict[str, float]:
    out = {}
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith("infermesh_engine_shared_cache_") and 'replica="metrics-test"' in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_counters_follow_the_stats_and_leave_with_the_replica() -> None:
    remote, outbox = Remote(), Outbox(max_bytes=1 << 20)
    replica = metrics.ReplicaMetrics("metrics-test")
    replica.watch_shared_cache(remote, outbox)
    try:
        assert scrape()['infermesh_engine_shared_cache_blocks_total{event="fetched",replica="metrics-test"}'] == 0
        remote.stats.fetched_blocks, remote.stats.rejected_blocks, remote.stats.published_blocks = 7, 1, 5
        remote.stats.dropped_blocks, remote.stats.errors = 2, 3
        outbox.dropped_blocks = 4                      # dropped for room before they were sent
        got = scrape()
        blocks = {event: got[f'infermesh_engine_shared_cache_blocks_total{{event="{event}",replica="metrics-test"}}']
                  for event in metrics.SHARED_CACHE_EVENTS}
        assert blocks == {"fetched": 7, "rejected": 1, "published": 5, "dropped": 6}
        assert got['infermesh_engine_shared_cache_errors_total{replica="metrics-test"}'] == 3
    finally:
        replica.close()
    assert scrape() == {}
    assert "# TYPE infermesh_engine_shared_cache_blocks_total counter" in generate_latest(REGISTRY).decode()
