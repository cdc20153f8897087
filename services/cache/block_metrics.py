"""Prometheus metrics of the KV block store (served on --metrics-port).

Read from `BlockStore.stats()` at scrape time, so /metrics and GetStats always agree and the
store keeps one set of counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import REGISTRY, CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.cache.store import BlockStore

PREFIX = "infermesh_cache_block"


class BlockStoreCollector(Collector):
    def __init__(self, store: BlockStore, replica: str):
        self.store = store
        self.replica = replica

    def collect(self) -> Iterator[Metric]:
        s, r = self.store.stats(), self.replica

        def per_tier(family: CounterMetricFamily | GaugeMetricFamily, hot: int, cold: int
                     ) -> CounterMetricFamily | GaugeMetricFamily:
            family.add_metric([r, "hot"], hot)
            family.add_metric([r, "cold"], cold)
            return family

        def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["replica"])
            family.add_metric([r], value)
            return family

        tier = ["replica", "tier"]
        yield per_tier(CounterMetricFamily(f"{PREFIX}_hits", "Block lookups found in this tier", labels=tier),
                       s.hot_hits, s.cold_hits)
        yield per_tier(CounterMetricFamily(f"{PREFIX}_misses", "Block lookups not found in this tier", labels=tier),
                       s.hot_misses, s.cold_misses)
        yield per_tier(CounterMetricFamily(f"{PREFIX}_evictions", "Blocks evicted from this tier to make room",
                                           labels=tier), s.hot_evictions, s.cold_evictions)
        io = CounterMetricFamily(f"{PREFIX}_bytes", "Block payload bytes received (in) and served (out)",
                                 labels=["replica", "direction"])
        io.add_metric([r, "in"], s.bytes_in)
        io.add_metric([r, "out"], s.bytes_out)
        yield io
        yield counter("promotions", "Cold hits copied into RAM", s.promotions)
        yield counter("demotions", "Blocks pushed out of RAM that were kept on disk", s.demotions)
        yield counter("corrupt", "Torn or corrupt block files found and deleted", s.corrupt)
        yield counter("prefix_queried", "Chained hashes asked about by MatchPrefix", s.match_queried)
        yield counter("prefix_matched", "Chained hashes MatchPrefix found stored", s.match_matched)
        yield per_tier(GaugeMetricFamily(f"{PREFIX}_tier_bytes", "Bytes held by this tier", labels=tier),
                       s.hot_bytes, s.cold_bytes)
        yield per_tier(GaugeMetricFamily(f"{PREFIX}_tier_blocks", "Blocks held by this tier", labels=tier),
                       s.hot_blocks, s.cold_blocks)
        yield per_tier(GaugeMetricFamily(f"{PREFIX}_tier_budget_bytes", "Byte budget of this tier", labels=tier),
                       s.hot_budget, s.cold_budget)


def watch(store: BlockStore, replica: str, registry: CollectorRegistry = REGISTRY) -> BlockStoreCollector:
    collector = BlockStoreCollector(store, replica)
    registry.register(collector)
    return collector
