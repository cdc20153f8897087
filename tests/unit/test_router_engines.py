"""The engine client's conversions (services/router/engines.py): LoadReport <-> meshpb.v1.LoadReport, the engine's
GenerateRequest from an EngineRequest, and its GenerateResponse as an EngineReply."""

from __future__ import annotations

import dataclasses
from dataclasses import fields

from mesh.clients.values import TokenLogprob, TopLogprob
from mesh.sampling import Sampling
from mesh.sampling_pb import from_pb
from meshpb.v1 import common_pb2, engine_pb2
from services.router.engines import EngineReply, EngineRequest, load_from_pb, load_to_pb, reply_from_pb, request_to_pb
from services.router.replicas import LoadReport, TenantShare
from services.router.request import Usage


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


def test_an_engine_request_carries_every_field() -> None:
    sampling = Sampling(temperature=0.5, seed=3, max_tokens=8, stop=("x",), prompt_logprobs=True)
    request = EngineRequest("r-1~shadow", "small", [1, 2, 3], sampling, "batch", [4], b"salt", "premium", "acme", 2.0,
                            "alpha")
    msg = request_to_pb(request)
    assert (msg.request_id, msg.model, list(msg.prompt_ids), list(msg.resume_ids), msg.cache_salt, msg.cache_class,
            msg.tenant, msg.weight, msg.adapter) == ("r-1~shadow", "small", [1, 2, 3], [4], b"salt", "premium", "acme",
                                                    2.0, "alpha")
    assert msg.priority == common_pb2.PRIORITY_BATCH and from_pb(msg.sampling) == sampling
    assert request_to_pb(dataclasses.replace(request, priority="interactive")).priority == \
        common_pb2.PRIORITY_INTERACTIVE
    assert set(engine_pb2.GenerateRequest.DESCRIPTOR.fields_by_name) == {f.name for f in fields(EngineRequest)}


def test_an_engine_reply_reads_into_plain_values() -> None:
    msg = engine_pb2.GenerateResponse(ids=[7, 8], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                      usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
                                      logprobs=[common_pb2.TokenLogprob(token_id=7, logprob=-0.5, top=[
                                          common_pb2.TopLogprob(token_id=9, logprob=-1.5)])],
                                      prompt_logprobs=[common_pb2.TokenLogprob(token_id=1, logprob=-3.0)],
                                      embedding=[0.5, -0.25])
    assert reply_from_pb(msg) == EngineReply((7, 8), "length", Usage(3, 2, 1),
                                             (TokenLogprob(7, "", -0.5, (TopLogprob(9, "", -1.5),)),),
                                             (TokenLogprob(1, "", -3.0),), (0.5, -0.25))
    assert reply_from_pb(engine_pb2.GenerateResponse(ids=[5])) == EngineReply((5,))
    assert [reply_from_pb(engine_pb2.GenerateResponse(finish_reason=r)).finish_reason for r in (
        common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_ABORT, common_pb2.FINISH_REASON_ERROR)] == \
        ["stop", "abort", "error"]
