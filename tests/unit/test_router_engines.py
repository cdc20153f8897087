"""The router's LoadReport <-> meshpb.v1.LoadReport pair (services/router/engines.py)."""

from __future__ import annotations

from dataclasses import fields

from meshpb.v1 import common_pb2
from services.router.engines import load_from_pb, load_to_pb
from services.router.replicas import LoadReport, TenantShare


def test_every_field_goes_both_ways() -> None:
    report = LoadReport(running=3, waiting=2, kv_blocks_total=200, kv_blocks_free=50, qps=1.5, p50_latency_ms=10.5,
                        p99_latency_ms=90.25, tokens_per_second=300.0, unix_ms=1_700_000_000_123,
                        tenants=(TenantShare("key:ab12", 2, 1, 900), TenantShare("", 1, 1, 40)),
                        adapters=("alpha", "beta"), adapter_paths=("/a", "/b"))
    msg = load_to_pb("engine-0", report)
    assert msg.replica_id == "engine-0"
    assert load_from_pb(msg) == report        # these floats are exact in float32
    assert {f.name for f in fields(LoadReport)} | {"replica_id"} == set(common_pb2.LoadReport.DESCRIPTOR.fields_by_name)


def test_an_empty_report_is_all_zeros() -> None:
    assert load_from_pb(common_pb2.LoadReport()) == LoadReport()
