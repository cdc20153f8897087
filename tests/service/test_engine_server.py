"""The engine's servicer in-process on loopback, on a tiny random Llama: a model failure fails exactly the
requests the engine held (INTERNAL) and the engine keeps serving; GetInfo and /metrics report the plan."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from mesh.grpcutil import Service, channel
from meshpb.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.config import EngineConfig
from services.engine.core.request import FinishReason, SamplingParams
from services.engine.engine import Engine
from services.engine.rpcs import server as engine_server
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_runner(folder: Path) -> ModelRunner:
    return ModelRunner(folder, decide(device="cpu", dtype="float32"), kv_cache_bytes=1 << 20, block_size=4)


class FailOnce:
    """runner.run that, on its first call, waits for `go` and raises; then runs the model as before."""

    def __init__(self, runner: ModelRunner):
        self.run, self.go, self.entered, self.calls = runner.run, threading.Event(), threading.Event(), 0
        runner.run = self  # type: ignore[method-assign]

    def __call__(self, chunks: Any, greedy: bool = False) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            self.go.wait(10)
            raise RuntimeError("device lost")
        return self.run(chunks, greedy=greedy)


def failed_step(folder: Path, scheduler: Any = None) -> tuple[Engine, SamplingParams]:
    """An engine holding requests a and b whose first step failed ("device lost")."""
    runner = make_runner(folder)
    engine = Engine(runner, scheduler=scheduler)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for rid in ("a", "b"):
        engine.add(engine.make_request(rid, [5, 6, 7], params))
    FailOnce(runner).go.set()
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    return engine, params


def test_fail_all_ends_every_held_request_with_an_error_and_the_engine_goes_on(folder: Path) -> None:
    engine, params = failed_step(folder)
    failed = engine.fail_all()
    assert [(o.request_id, o.finish_reason, o.new_ids) for o in failed] == [
        ("a", FinishReason.ERROR, ()), ("b", FinishReason.ERROR, ())]
    assert engine.blocks.num_used_blocks == 0 and not engine.has_work()
    engine.add(engine.make_request("c", [5, 6, 7], params))
    outs = [o for _ in range(3) for o in engine.step()]
    assert [len(o.new_ids) for o in outs] == [1, 1, 1] and outs[-1].finish_reason is FinishReason.LENGTH


def test_a_failed_step_fails_the_requests_it_ran_and_no_others(folder: Path) -> None:
    """Issue 20: with one sequence per step, a's failing step holds b outside its batch: only a fails."""
    from services.engine.core.scheduler import SchedulerConfig

    engine, params = failed_step(folder, SchedulerConfig(max_running=1))
    assert engine.num_waiting == 1                      # b was held back, outside the batch
    failed = engine.fail_step()
    assert [(o.request_id, o.finish_reason) for o in failed] == [("a", FinishReason.ERROR)]
    outs = engine.run_until_idle()
    assert list(outs) == ["b"] and len(outs["b"]) == 3 and outs["b"][-1].finish_reason is FinishReason.LENGTH
    alone = Engine(make_runner(folder))
    alone.add(alone.make_request("b", [5, 6, 7], params))
    ref = [t for _ in range(3) for o in alone.step() for t in o.new_ids]
    assert [t for o in outs["b"] for t in o.new_ids] == ref
    assert engine.blocks.num_used_blocks == 0 and not engine.has_work()


@asynccontextmanager
async def serving(folder: Path) -> AsyncIterator[tuple[engine_pb2_grpc.EngineStub, engine_server.EngineServicer]]:
    config = EngineConfig(model_path=str(folder), replica_id="engine-t")
    servicer = engine_server.EngineServicer(Engine(make_runner(folder)), config)
    service = Service("meshpb.v1.Engine", "127.0.0.1", 0)
    engine_server.add_to(service, servicer)
    await service.start()
    servicer.start()
    ch = channel(f"127.0.0.1:{service.port}")
    try:
        yield engine_pb2_grpc.EngineStub(ch), servicer
    finally:
        await ch.close()
        await servicer.close()
        await service.stop(0)


def request(rid: str) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=rid, prompt_ids=[5, 6, 7],
                                      sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True))


def test_a_failed_step_is_internal_for_its_requests_only(folder: Path) -> None:
    async def scenario() -> None:
        async with serving(folder) as (stub, servicer):
            failing = FailOnce(servicer.engine.runner)
            first = asyncio.ensure_future(stub.Generate(request("a")).read())
            while not failing.entered.is_set():                 # a's step is running the model
                await asyncio.sleep(0.01)
            later = stub.Generate(request("b"))
            second = asyncio.ensure_future(_collect(later))
            while servicer.engine.num_waiting < 1:              # b waits in the inbox, outside the step
                await asyncio.sleep(0.01)
            failing.go.set()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await first
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            assert "engine engine-t failed while running the model" in (failed.value.details() or "")
            replies = await second                              # the engine kept serving b
            assert sum(len(r.ids) for r in replies) == 3    # (queued tokens may share a message)
            assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    asyncio.run(scenario())


async def _collect(call: Any) -> list[engine_pb2.GenerateResponse]:
    return [reply async for reply in call]


def test_get_info_and_metrics_report_the_execution_plan(folder: Path) -> None:
    async def scenario() -> None:
        async with serving(folder) as (stub, _):
            info = await stub.GetInfo(engine_pb2.EngineInfoRequest())
            assert (info.plan.device, info.plan.dtype, info.plan.matmul, info.plan.attention, info.plan.ops,
                    info.plan.graphs, info.plan.matmul_large, info.plan.kv_dtype) == (
                "cpu", "float32", "exact", "torch", "torch", "off", "", "float32")
            assert (info.device, info.dtype) == ("cpu", "float32")
            labels = {"replica": "engine-t", "device": "cpu", "dtype": "float32", "matmul": "exact",
                      "attention": "torch", "ops": "torch", "graphs": "off", "matmul_large": "",
                      "split_rows": "0", "kv_dtype": "float32"}
            assert REGISTRY.get_sample_value("infermesh_engine_plan_info", labels) == 1.0
        assert REGISTRY.get_sample_value("infermesh_engine_plan_info", labels) is None   # withdrawn at close

    asyncio.run(scenario())
